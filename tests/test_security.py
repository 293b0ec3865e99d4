"""Hostile requests: paths out of the session store, oversized or malformed bodies, missing
keys, a full store. Real servers over HTTP, tiny model; every test checks that nothing on disk
changed where it must not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import REPO, running_server, server_process, tree_snapshot

TINY = ("--device", "cpu", "--dtype", "float32")
CONTEXT = "The code name of the blue box is Orchid-417. " * 3
BAD_IDS = [".", "..", ".tmp-x", ".trash-x", "a/b", "a\\b", "a\x00b", "x" * 300, "sé", "-x", "a b"]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A CDLM_SERVE_HOME with data in it beside the session store."""
    home = tmp_path_factory.mktemp("home")
    (home / "models" / "precious").mkdir(parents=True)
    (home / "models" / "precious" / "weights.bin").write_bytes(os.urandom(1024))
    (home / "keep.txt").write_text("do not delete")
    return home


@pytest.fixture(scope="module")
def base(tiny_llama_dir, home):
    # No --sessions-dir: the default, $CDLM_SERVE_HOME/sessions, as a user would run it.
    args = ("--model", f"tiny={tiny_llama_dir}", *TINY, "--max-body-mb", "1")
    with server_process(args, {"CDLM_SERVE_HOME": str(home)}, 300) as (url, _):
        yield url


def test_the_reported_attack_leaves_the_data_directory_intact(base, home):
    before = tree_snapshot(home)
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": ".."})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id", r.text
    # httpx would normalize '/..': send the raw path, as curl does with %2E%2E.
    for raw in ("/v1/sessions/%2E%2E", "/v1/sessions/..%2F..", "/v1/sessions/%2E"):
        r = httpx.request("DELETE", httpx.URL(base).copy_with(raw_path=raw.encode()))
        assert r.status_code in (400, 404), (raw, r.status_code, r.text)
    assert tree_snapshot(home) == before
    assert (home / "keep.txt").read_text() == "do not delete"


@pytest.mark.parametrize("sid", BAD_IDS)
def test_bad_session_ids_are_refused_everywhere(base, home, sid):
    before = tree_snapshot(home)
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": sid, "prompt": "x"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    quoted = "".join(
        c if c.isascii() and c.isalnum() else "".join(f"%{b:02X}" for b in c.encode()) for c in sid
    )
    for method, path, body in (
        ("GET", f"/v1/sessions/{quoted}", None),
        ("DELETE", f"/v1/sessions/{quoted}", None),
        ("POST", f"/v1/sessions/{quoted}/compact", {"ratio": 2}),
    ):
        url = httpx.URL(base).copy_with(raw_path=path.encode())
        r = httpx.request(method, url, json=body)
        assert r.status_code in (400, 404), (method, sid, r.status_code, r.text)
        assert "error" in r.json()
    r = httpx.post(
        f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "session_id": sid}
    )
    assert r.status_code == 400, r.text
    assert tree_snapshot(home) == before


def test_store_refuses_paths_outside_its_root(tmp_path):
    """Defence in depth below the HTTP layer: ids are checked again, and a folder that resolves
    elsewhere (a planted symlink) is never read, written or deleted."""
    from cdlm_serve.engine.sessions.session import SessionError
    from cdlm_serve.engine.sessions.store import SessionStore

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "meta.json").write_text("{}")
    root = tmp_path / "store"
    root.mkdir()
    (root / "evil").symlink_to(outside, target_is_directory=True)
    store = SessionStore(root, 1 << 20)
    assert "evil" not in store.ids()  # not loaded through the link
    for sid in [*BAD_IDS, "evil"]:
        with pytest.raises(SessionError):
            store.folder(sid)
    with pytest.raises(SessionError):
        store.create("m", "evil")
    assert (outside / "meta.json").read_text() == "{}"


def test_body_and_field_limits(base):
    post = lambda body: httpx.post(f"{base}/v1/completions", json=body, timeout=60)  # noqa: E731
    big = httpx.post(
        f"{base}/v1/completions",
        content=b'{"model": "tiny", "prompt": "' + b"a" * (2 << 20) + b'"}',
        headers={"content-type": "application/json"},
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def streamed():  # no Content-Length: cut off while it streams in
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(64):
            yield b"a" * 32768
        yield b'"}'

    r = httpx.post(f"{base}/v1/completions", content=streamed())
    assert r.status_code == 413, r.text
    cases = [
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": ["a"] * 10, "n": 8}, "n"),
        ({"prompt": "a", "seed": 2**63}, "seed"),
        ({"prompt": "a", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "a", "max_tokens": 10**30}, "max_tokens"),
        ({"prompt": "a", "stop": "x" * 257}, "stop"),
        ({"prompt": "a", "logprobs": 10**6}, "logprobs"),
        ({"prompt": "a" * 600_000}, "prompt"),
    ]
    for extra, param in cases:
        r = post({"model": "tiny", **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    for raw in (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', b'{"model": "tiny", '):
        r = httpx.post(
            f"{base}/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
    # The extremes that are allowed still work.
    r = post({"model": "tiny", "prompt": "a", "seed": 2**63 - 1, "n": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = post({"model": "tiny", "prompt": "a", "seed": -(2**63), "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_compaction_requests_are_bounded(base):
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "cb", "prompt": CONTEXT})
    assert r.status_code == 201, r.text
    n = r.json()["tokens"]
    for body, param in (
        ({"ratio": 1.2}, "ratio"),
        ({"target_tokens": n}, "target_tokens"),
        ({"target_tokens": n - 1}, "target_tokens"),
        ({"ratio": 2, "keep_recent": n - 1}, "keep_recent"),
    ):
        r = httpx.post(f"{base}/v1/sessions/cb/compact", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(
        f"{base}/v1/sessions/cb/compact",
        json={"target_tokens": n // 4, "method": "am-omp"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["tokens_after"] == n // 4 and report["fallback"] is None
    assert report["engine_jobs"] > 2  # the capture ran in pieces, one layer each
    assert httpx.delete(f"{base}/v1/sessions/cb").status_code == 200


def test_omp_budget_falls_back_and_says_so(tiny_llama_dir):
    with running_server(
        "--model", f"tiny={tiny_llama_dir}", *TINY, "--compaction-omp-budget", "0.000001"
    ) as url:
        httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "o", "prompt": CONTEXT})
        r = httpx.post(
            f"{url}/v1/sessions/o/compact", json={"ratio": 4, "method": "am-omp"}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert "highest-attention keys from layer 0" in r.json()["fallback"]
        assert r.json()["session"]["physical_tokens"] == -(-len(CONTEXT.encode()) // 4)


def test_every_v1_route_needs_the_key(tiny_llama_dir):
    key = "s3cret-key"
    with running_server("--model", f"tiny={tiny_llama_dir}", *TINY, "--api-key", key) as url:
        routes = [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 1}),
            (
                "POST",
                "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "a"}]},
            ),
            ("POST", "/v1/sessions", {"model": "tiny", "id": "k", "prompt": "abc"}),
            ("GET", "/v1/sessions", None),
            ("GET", "/v1/sessions/k", None),
            ("POST", "/v1/sessions/k/compact", {"target_tokens": 1}),
            ("DELETE", "/v1/sessions/k", None),
            ("GET", "/v1/nothing-here", None),
            ("GET", "/V1/models", None),
        ]
        auth = {"Authorization": f"Bearer {key}"}
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
            r = httpx.request(method, f"{url}{path}", json=body, headers=auth, timeout=60)
            assert r.status_code != 401, (method, path, r.text)
            if path not in ("/v1/nothing-here", "/V1/models"):
                assert r.status_code < 300, (method, path, r.text)
        for path in ("/health", "/version", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 200


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_api_key_is_a_startup_error(tiny_llama_dir, how):
    cmd = [
        sys.executable,
        "-m",
        "cdlm_serve.server.cli",
        "serve",
        "--model",
        f"tiny={tiny_llama_dir}",
    ]
    env = dict(os.environ)
    if how == "flag":
        cmd += ["--api-key", ""]
    else:
        env["CDLM_SERVE_API_KEY"] = ""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "API key" in proc.stderr, proc.stderr[-1000:]


def test_a_full_store_refuses_instead_of_evicting(tiny_llama_dir, tmp_path):
    store = tmp_path / "sessions"
    with running_server(
        "--model", f"tiny={tiny_llama_dir}", *TINY, "--sessions-dir", str(store),
        "--max-sessions", "2",
    ) as url:  # fmt: skip
        for sid in ("a", "b"):
            r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": sid, "prompt": "x"})
            assert r.status_code == 201
        before = tree_snapshot(store)
        r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "c", "prompt": "x"})
        assert r.status_code == 507 and r.json()["error"]["type"] == "insufficient_storage"
        assert tree_snapshot(store) == before
    # A disk quota: 20 KB holds a few tokens of the tiny model (512 bytes each), not 300.
    with running_server(
        "--model", f"tiny={tiny_llama_dir}", *TINY, "--sessions-dir", str(tmp_path / "q"),
        "--sessions-disk-gb", "0.00002",
    ) as url:  # fmt: skip
        r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "a", "prompt": "x" * 8})
        assert r.status_code == 201, r.text
        before = tree_snapshot(tmp_path / "q")
        r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "b", "prompt": "y" * 300})
        assert r.status_code == 507, r.text
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "session_id": "a", "prompt": "z", "max_tokens": 400},
        )
        assert r.status_code == 507, r.text
        assert tree_snapshot(tmp_path / "q") == before
        assert httpx.get(f"{url}/v1/sessions/a").json()["tokens"] == 8
