"""Sessions over HTTP: create, continue, compact, persist across a restart, stay consistent
under concurrent use. Real servers, tiny model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import tiny_session_server

CONTEXT = "The code name of the blue box is Orchid-417. " * 3


def _complete(base: str, **body) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "max_tokens": 8, "temperature": 0, **body},
        timeout=120,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def base(tiny_llama_dir, store):
    with tiny_session_server(tiny_llama_dir, store, "--session-lock-wait", "0.05") as url:
        yield url


def test_session_continues_exactly_like_the_whole_prompt(base):
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "s1", "prompt": CONTEXT})
    assert r.status_code == 201
    info = r.json()
    n = len(CONTEXT.encode())
    assert (info["tokens"], info["logical_length"], info["physical_tokens"]) == (n, n, n)
    assert info["bytes"] > 0 and info["compactions"] == []
    stateless = _complete(base, prompt=CONTEXT + "Q:").json()["choices"][0]["text"]
    peek = _complete(base, prompt="Q:", session_id="s1", append=False).json()
    assert peek["choices"][0]["text"] == stateless
    assert httpx.get(f"{base}/v1/sessions/s1").json()["tokens"] == n  # append=false
    first = _complete(base, prompt="Q:", session_id="s1").json()
    assert first["choices"][0]["text"] == stateless
    grown = httpx.get(f"{base}/v1/sessions/s1").json()
    assert grown["tokens"] == n + 2 + first["usage"]["completion_tokens"]
    # The next request continues after the answer, as if everything had been one prompt.
    second = _complete(base, prompt="R:", session_id="s1").json()["choices"][0]["text"]
    whole = CONTEXT + "Q:" + stateless + "R:"
    assert second == _complete(base, prompt=whole).json()["choices"][0]["text"]


def test_compaction_and_restart(tiny_llama_dir, tmp_path):
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:
        httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "doc", "prompt": CONTEXT})
        r = httpx.post(
            f"{url}/v1/sessions/doc/compact",
            json={"ratio": 4, "method": "am-highest", "query_source": "repeat", "keep_recent": 16},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        report = r.json()
        n = len(CONTEXT.encode())
        region = n - 16
        assert report["tokens_before"] == n and report["target"] == -(-region // 4)
        assert report["tokens_after"] == report["target"] + 16 and report["logical_length"] == n
        assert set(report["seconds"]) >= {"queries", "keys", "beta", "values", "total"}
        info = httpx.get(f"{url}/v1/sessions/doc").json()
        assert info["physical_tokens"] == report["tokens_after"] and len(info["compactions"]) == 1
        # What memory holds is what is left: the reference pass grew the buffers to the context
        # run twice, and the compaction gives that back (fp32 K and V, a bias, per slot/head).
        cfg = json.loads((tiny_llama_dir / "config.json").read_text())
        heads = cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        assert info["bytes"] == info["physical_tokens"] * heads * (2 * head_dim * 4 + 4)
        before = _complete(url, prompt="Q:", session_id="doc", append=False).json()
        metrics = httpx.get(f"{url}/metrics").text
        assert 'cdlm_serve:compaction_seconds_count{method="am-highest"} 1.0' in metrics
        assert "cdlm_serve:sessions 1.0" in metrics
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:  # a new process over the same store
        info2 = httpx.get(f"{url}/v1/sessions/doc").json()
        assert info2["logical_length"] == info["logical_length"]
        assert info2["compactions"] == info["compactions"]
        after = _complete(url, prompt="Q:", session_id="doc", append=False).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert (
            httpx.get(f"{url}/v1/sessions/doc").json()["physical_tokens"] == info["physical_tokens"]
        )


def test_a_non_uniform_session_rests_ragged_and_answers_alike(tiny_llama_dir, tmp_path):
    """Budgets that differ per head pad the shorter heads while a request runs; at rest (in
    memory between requests, on disk) the session takes the bytes of a uniform one with the
    same total slots plus a mask byte per slot and head, and answers the same after a restart."""
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    heads = cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
    body = {"ratio": 4, "method": "am-highest", "keep_recent": 16}
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:
        for sid, budgets in (("uniform", "uniform"), ("ragged", "attention")):
            httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": sid, "prompt": CONTEXT})
            r = httpx.post(
                f"{url}/v1/sessions/{sid}/compact", json=body | {"budgets": budgets}, timeout=300
            )
            assert r.status_code == 200, r.text
        uniform = httpx.get(f"{url}/v1/sessions/uniform").json()
        ragged = httpx.get(f"{url}/v1/sessions/ragged").json()
        assert ragged["physical_tokens"] > uniform["physical_tokens"]  # padded while in use
        assert ragged["in_memory"] and uniform["in_memory"]
        # the same visible slots; a mask byte per slot and head in each layer with padding
        assert uniform["bytes"] < ragged["bytes"]
        assert ragged["bytes"] <= uniform["bytes"] + heads * ragged["physical_tokens"]
        assert ragged["disk_bytes"] < uniform["disk_bytes"] * 1.1
        before = _complete(url, prompt="Q:", session_id="ragged", append=False).json()
        assert httpx.get(f"{url}/v1/sessions/ragged").json()["bytes"] == ragged["bytes"]
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:  # from the ragged files
        after = _complete(url, prompt="Q:", session_id="ragged", append=False).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert httpx.get(f"{url}/v1/sessions/ragged").json()["bytes"] == ragged["bytes"]


def test_openai_client_creates_compacts_and_continues_a_session(base):
    """What a user of the official SDK does: custom routes through client.post/get, the
    completion with extra_body={"session_id": ...}."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    client.post("/sessions", body={"model": "tiny", "id": "sdk", "prompt": CONTEXT}, cast_to=object)
    report = client.post(
        "/sessions/sdk/compact",
        body={"ratio": 4, "method": "am-highest-fast", "keep_recent": 8},
        cast_to=object,
    )
    assert report["tokens_after"] < report["tokens_before"] == len(CONTEXT.encode())
    out = client.completions.create(
        model="tiny",
        prompt="Q:",
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": "sdk"},
    )
    info = client.get("/sessions/sdk", cast_to=object)
    # The prompt and the answer were appended; the cache grew by as much on top of its
    # compacted size (the last answer token waits, uncached, for the next request).
    assert info["tokens"] == report["tokens_before"] + len(b"Q:") + out.usage.completion_tokens
    grown = info["logical_length"] - report["logical_length"]
    assert grown >= len(b"Q:") and info["physical_tokens"] == report["tokens_after"] + grown
    assert len(info["compactions"]) == 1


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/sessions/nope/compact", {"ratio": 2}, 404, "session_id"),
        ("/v1/sessions/s2/compact", {"ratio": 0.5}, 400, "ratio"),
        ("/v1/sessions/s2/compact", {"target_tokens": 10_000}, 400, "target_tokens"),
        ("/v1/sessions/s2/compact", {"ratio": 2, "method": "magic"}, 400, "method"),
        ("/v1/sessions/s2/compact", {"ratio": 2, "key_queries": "magic"}, 400, "key_queries"),
        (
            "/v1/sessions/s2/compact",
            {"ratio": 2, "method": "am-omp", "key_queries": "context"},
            400,
            "key_queries",
        ),
        ("/v1/sessions/s2/compact", {}, 400, "ratio"),
        ("/v1/sessions/s2/compact", {"ratio": 2, "keep_recent": 10_000}, 400, "keep_recent"),
        ("/v1/sessions", {"model": "tiny", "id": "s2"}, 409, "id"),
        ("/v1/sessions", {"model": "tiny", "id": "bad id!"}, 400, "id"),
        ("/v1/sessions", {"model": "ghost"}, 404, "model"),
        # A prompt is checked where every route's is (engine/limits.py `prompt_ids`).
        ("/v1/sessions", {"model": "tiny", "prompt": [5, 999_999]}, 400, "prompt"),
        ("/v1/sessions", {"model": "tiny", "prompt": [5] * 512}, 400, "prompt"),
    ],
)
def test_session_errors(base, path, body, status, param):
    httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "s2", "prompt": CONTEXT})
    r = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_session_in_a_completion_is_404(base):
    r = _complete(base, prompt="x", session_id="missing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_busy_session_answers_409_and_concurrent_use_stays_consistent(base):
    httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "busy", "prompt": CONTEXT})

    async def storm():
        async with httpx.AsyncClient(timeout=300) as client:
            holder = {
                "model": "tiny",
                "prompt": "Z",
                "max_tokens": 300,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "session_id": "busy",
            }
            async with client.stream("POST", f"{base}/v1/completions", json=holder) as long:
                chunks = long.aiter_lines()
                await anext(chunks)  # the first token is out: the session's lock is held now
                others = await asyncio.gather(
                    client.post(f"{base}/v1/sessions/busy/compact", json={"ratio": 2}),
                    client.post(
                        f"{base}/v1/completions",
                        json={
                            "model": "tiny",
                            "prompt": "Y",
                            "max_tokens": 4,
                            "session_id": "busy",
                        },
                    ),
                )
                lines = [line async for line in chunks]
            return long, lines, others

    first, lines, others = asyncio.run(storm())
    assert first.status_code == 200 and "data: [DONE]" in lines[-2:], lines[-3:]
    codes = [r.status_code for r in others]
    assert set(codes) <= {200, 409} and 409 in codes  # the lock wait (0.05 s) ran out
    assert all(r.json()["error"]["code"] == "session_busy" for r in others if r.status_code == 409)
    info = httpx.get(f"{base}/v1/sessions/busy").json()
    assert info["physical_tokens"] <= info["logical_length"] < info["tokens"] + 1
    # Still usable: one more completion and one more compaction both succeed.
    assert _complete(base, prompt="W", session_id="busy").status_code == 200
    r = httpx.post(f"{base}/v1/sessions/busy/compact", json={"ratio": 2}, timeout=300)
    assert r.status_code == 200, r.text
    assert (
        json.loads(r.text)["session"]["logical_length"]
        == httpx.get(f"{base}/v1/sessions/busy").json()["logical_length"]
    )


def test_an_answered_append_is_already_on_disk(base, store):
    """What a client is told has happened is on disk when it is told: the answer (or the
    stream's [DONE]) comes after the session's new version is committed."""
    httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "disk", "prompt": CONTEXT})

    def on_disk() -> int:
        return len(json.loads((store / "disk" / "meta.json").read_text())["tokens"])

    n = on_disk()
    r = _complete(base, prompt="Q:", session_id="disk")
    grown = n + 2 + r.json()["usage"]["completion_tokens"] - 1  # the last token is the next input
    assert on_disk() == grown == httpx.get(f"{base}/v1/sessions/disk").json()["tokens"] - 1
    body = {"model": "tiny", "prompt": "R:", "max_tokens": 5, "temperature": 0}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "session_id": "disk", "stream": True}
    ) as stream:
        at_done = [on_disk() for line in stream.iter_lines() if line == "data: [DONE]"]
    assert at_done and at_done[0] > grown  # read the moment [DONE] arrived


def test_session_can_be_named_by_the_x_session_id_header(base):
    """Routers hash a header, not a JSON body: the header names the session as well."""
    httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "hdr", "prompt": CONTEXT})
    body = {"model": "tiny", "prompt": "Q:", "max_tokens": 6, "temperature": 0, "append": False}
    url = f"{base}/v1/completions"
    by_body = httpx.post(url, json={**body, "session_id": "hdr"}).json()
    by_header = httpx.post(url, json=body, headers={"X-Session-Id": "hdr"}).json()
    both = httpx.post(url, json={**body, "session_id": "hdr"}, headers={"X-Session-Id": "hdr"})
    assert by_header["choices"][0]["text"] == by_body["choices"][0]["text"]
    assert both.json()["choices"][0]["text"] == by_body["choices"][0]["text"]
    disagree = httpx.post(url, json={**body, "session_id": "s1"}, headers={"X-Session-Id": "hdr"})
    assert disagree.status_code == 400 and disagree.json()["error"]["param"] == "session_id"
    bad = httpx.post(url, json=body, headers={"X-Session-Id": "../etc"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-session-id"
    missing = httpx.post(url, json=body, headers={"X-Session-Id": "no-such"})
    assert missing.status_code == 404  # the header alone names a session


def test_a_compaction_that_names_no_method_runs_the_default_kvzip_with_global_budgets(base):
    """`method` defaults to "auto" on every route (engine.compaction.options.resolve_auto):
    KVzip's keys with the slots shared over every head; budgets named with it are kept, and a
    session's policy stores what it resolved to."""
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "auto1", "prompt": CONTEXT})
    assert r.status_code == 201
    r = httpx.post(
        f"{base}/v1/sessions/auto1/compact", json={"ratio": 4, "keep_recent": 16}, timeout=300
    )
    assert r.status_code == 200, r.text
    assert (r.json()["method"], r.json()["budgets"]) == ("kvzip", "global")
    info = httpx.get(f"{base}/v1/sessions/auto1").json()
    assert info["compactions"][-1]["method"] == "kvzip"
    assert 'compaction_seconds_count{method="kvzip"}' in httpx.get(f"{base}/metrics").text

    httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "auto2", "prompt": CONTEXT})
    r = httpx.post(
        f"{base}/v1/sessions/auto2/compact",
        json={"ratio": 4, "method": "auto", "budgets": "uniform"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert (r.json()["method"], r.json()["budgets"]) == ("kvzip", "uniform")

    r = httpx.post(
        f"{base}/v1/sessions",
        json={"model": "tiny", "id": "auto3", "auto_compact": {"max_tokens": 64, "ratio": 4}},
    )
    assert r.status_code == 201, r.text
    policy = httpx.get(f"{base}/v1/sessions/auto3").json()["auto_compact"]
    assert (policy["method"], policy["budgets"]) == ("kvzip", "global")
    # A method named with its own budgets keeps uniform ones unless asked.
    r = httpx.post(
        f"{base}/v1/sessions",
        json={
            "model": "tiny",
            "id": "auto4",
            "auto_compact": {"max_tokens": 64, "ratio": 4, "method": "am-highest-fast"},
        },
    )
    policy = httpx.get(f"{base}/v1/sessions/auto4").json()["auto_compact"]
    assert (policy["method"], policy["budgets"]) == ("am-highest-fast", "uniform")
