"""Fuzzing: session ids straight into the store, and malformed bodies (broken JSON, odd unicode,
huge and non-finite numbers, wrong types) against every route of a real server. The server must
answer every one with a 4xx in OpenAI's error shape (or a success), never a 5xx, and the store
must never touch a path outside its root: every file beside the store, in the folder that holds
it, is the same (content, size, mtime) afterwards, and nothing new appears there."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdlm_serve.engine.sessions.session import SESSION_ID, SessionError
from cdlm_serve.engine.sessions.store import SessionStore
from conftest import running_server, tree_snapshot

ODD_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",))
    | st.sampled_from("./\\\x00.."),
    max_size=300,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sid=ODD_TEXT)
def test_store_ids(tmp_path_factory, sid):
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "store"
    (base / "outside.txt").write_text("x")
    before = tree_snapshot(base)
    store = SessionStore(root, 1 << 20)
    try:
        session = store.create("m", sid)
    except SessionError:
        assert not SESSION_ID.fullmatch(sid)
    else:
        assert SESSION_ID.fullmatch(sid)
        with session.lock:
            store.persist(session)
            folder = store.folder(sid)
            assert folder.parent == root.resolve() and (folder / "meta.json").is_file()
            store.delete(session)
    # Everything under the store's parent, recursively: only the (now empty) store is new.
    assert tree_snapshot(base) == {**before, "store": ("dir",)}


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | ODD_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "max_tokens", "n", "seed", "stop", "temperature", "logprobs",
          "session_id", "id", "ratio", "target_tokens", "keep_recent", "messages", "method",
          "block_size", "threshold", "stream"]  # fmt: skip
BODIES = st.one_of(
    st.binary(max_size=200),  # not JSON at all, or broken JSON, or not UTF-8
    st.builds(
        lambda d: json.dumps(d, allow_nan=True).encode(),
        st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6).map(
            lambda d: {"model": "tiny", **d} if "model" not in d else d
        ),
    ),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True).encode()),
)
ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/sessions"),
    ("POST", "/v1/sessions/fz/compact"),
    ("GET", "/v1/sessions/fz"),
    ("DELETE", "/v1/sessions/gone"),
    ("GET", "/v1/models"),
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """The server, its store, and a snapshot of the store's parent (a folder of its own, with a
    file beside the store) taken before the server started."""
    base = tmp_path_factory.mktemp("fuzz-server")
    store = base / "sessions"
    (base / "beside.txt").write_text("x")
    before = tree_snapshot(base)
    with running_server(
        "--model", f"tiny={tiny_llama_dir}", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "64", "--sessions-dir", str(store),
    ) as url:  # fmt: skip
        fz = {"model": "tiny", "id": "fz", "prompt": "a" * 20}
        assert httpx.post(f"{url}/v1/sessions", json=fz, timeout=60).status_code == 201
        yield url, store, before


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_malformed_bodies_never_crash_a_route(server, method, path):
    url, store, before = server
    client = httpx.Client(base_url=url, timeout=60)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=BODIES)
    def check(body: bytes) -> None:
        r = client.request(method, path, content=body, headers={"content-type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        if r.status_code >= 400 and not r.headers.get("content-type", "").startswith("text/"):
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["type"], r.text

    check()
    assert all(_inside(store, p) for p in store.rglob("*"))  # no link out of the store
    # Outside the store, under its parent, everything is as it was before the server started.
    assert tree_snapshot(store.parent, but=store) == {**before, "sessions": ("dir",)}
    assert httpx.get(f"{url}/health").status_code == 200


def _inside(root: Path, path: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())
