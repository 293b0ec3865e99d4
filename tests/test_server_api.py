"""The OpenAI surface beyond plain completions: chat, n, logprobs, auth, request ids, queue
limits and client disconnects. Real servers, tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest

from conftest import running_server

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    with running_server(
        "--model",
        f"tiny={tiny_llama_dir}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--api-key",
        KEY,
    ) as url:
        yield url


def _h(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _events(resp: httpx.Response) -> list:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in resp.text.splitlines()
        if line.startswith("data: ")
    ]


def test_auth_guards_v1_only(base):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    for headers in ({}, _h("wrong"), {"Authorization": KEY}):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.post(f"{base}/v1/completions", json=body, headers=_h()).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200
    assert httpx.get(f"{base}/version").json()["version"]


def test_request_ids_are_echoed_or_made(base):
    r = httpx.get(f"{base}/v1/models", headers={**_h(), "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(f"{base}/v1/models", headers=_h())
    assert len(r.headers["x-request-id"]) == 32


def test_chat_completion_and_stream(base):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    done = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    # The byte tokenizer's template renders this, one token per byte.
    assert done.usage.prompt_tokens == len(b"<system>be brief\n<user>hi\n<assistant>")
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_chat_rejects_what_it_cannot_do(base):
    bad = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}, "top_logprobs"),
    ]
    for extra, param in bad:
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", **extra}, headers=_h())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_n_choices_run_together_and_are_seeded(base):
    body = {"model": "tiny", "prompt": "xy", "max_tokens": 6, "n": 3, "seed": 4}
    a = httpx.post(f"{base}/v1/completions", json=body, headers=_h()).json()
    b = httpx.post(f"{base}/v1/completions", json=body, headers=_h()).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1  # different seeds per sample
    r = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, headers=_h())
    streamed: dict[int, str] = {}
    for e in _events(r)[:-1]:
        c = e["choices"][0]
        streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(3)] == [c["text"] for c in a["choices"]]


def test_completion_logprobs_shape(base):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0, "logprobs": 3}
    lp = httpx.post(f"{base}/v1/completions", json=body, headers=_h()).json()["choices"][0]
    lp = lp["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(v <= 0 for v in lp["token_logprobs"])
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 3 and math.isclose(max(top.values()), value, abs_tol=1e-5)
        assert top[tok] == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is best
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    assert lp["text_offset"] == offsets
    echo = httpx.post(f"{base}/v1/completions", json={**body, "echo": True}, headers=_h()).json()[
        "choices"
    ][0]["logprobs"]
    assert echo["tokens"][:3] == ["a", "b", "c"] and echo["token_logprobs"][0] is None
    assert echo["token_logprobs"][3:] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_chat_logprobs_shape(base):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "q"}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    choice = httpx.post(f"{base}/v1/chat/completions", json=body, headers=_h()).json()
    content = choice["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in content)
    assert all(len(e["top_logprobs"]) == 2 for e in content)


@pytest.fixture(scope="module")
def tight(tiny_llama_dir):
    with running_server(
        "--model",
        f"tiny={tiny_llama_dir}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-batch",
        "1",
        "--max-queue",
        "1",
    ) as url:
        yield url


def test_full_queue_answers_429(tight):
    long = {"model": "tiny", "prompt": "a", "max_tokens": 400, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            first = asyncio.create_task(client.post(f"{tight}/v1/completions", json=long))
            await asyncio.sleep(0.3)  # the first is decoding; the next one waits
            rest = [
                asyncio.create_task(client.post(f"{tight}/v1/completions", json=long))
                for _ in range(3)
            ]
            return [await t for t in [first, *rest]]

    codes = [r.status_code for r in asyncio.run(burst())]
    assert codes[0] == 200 and 429 in codes and set(codes) <= {200, 429}
    rejected = next(r for r in asyncio.run(burst()) if r.status_code == 429)
    assert (
        rejected.headers["retry-after"] and rejected.json()["error"]["type"] == "rate_limit_error"
    )


def _metric(base: str, name: str, label: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.split()[-1])
    return 0.0


def test_client_disconnect_aborts_the_request(tight):
    before = _metric(tight, "cdlm_serve:request_success_total", 'finished_reason="abort"')
    tokens_before = _metric(tight, "cdlm_serve:request_generation_tokens_sum", "tiny")
    with httpx.stream(
        "POST",
        f"{tight}/v1/completions",
        json={"model": "tiny", "prompt": "a", "max_tokens": 450, "stream": True, "temperature": 0},
    ) as r:
        for _ in r.iter_lines():
            break  # read one chunk, then hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _metric(tight, "cdlm_serve:num_requests_running", 'model_name="tiny"') == 0:
            break
        time.sleep(0.1)
    assert _metric(tight, "cdlm_serve:num_requests_running", 'model_name="tiny"') == 0
    # The aborted request left the engine long before 450 tokens could have been decoded,
    # and the server is free for the next one.
    after = _metric(tight, "cdlm_serve:request_success_total", 'finished_reason="abort"')
    assert after == before + 1
    # The engine dropped it long before its 450 tokens were decoded (counted by the engine
    # itself when the sequence left, aborted or not)...
    generated = _metric(tight, "cdlm_serve:request_generation_tokens_sum", "tiny")
    assert 0 < generated - tokens_before < 450
    # ...and the server is free for the next request.
    r = httpx.post(
        f"{tight}/v1/completions", json={"model": "tiny", "prompt": "b", "max_tokens": 3}
    )
    assert r.status_code == 200


def test_ignore_eos_generates_the_whole_budget(base):
    # Hot sampling from a random model: some of 8 samples meet end-of-text within 96 tokens...
    body = {"model": "tiny", "prompt": "q", "max_tokens": 96, "n": 8, "seed": 1, "temperature": 2}
    # (a long timeout: 768 tokens may take more than httpx's 5 s on a loaded 2-core machine)
    plain = httpx.post(f"{base}/v1/completions", json=body, headers=_h(), timeout=120).json()
    assert "stop" in {c["finish_reason"] for c in plain["choices"]}
    # ...and with ignore_eos every one runs to max_tokens.
    body["ignore_eos"] = True
    forced = httpx.post(f"{base}/v1/completions", json=body, headers=_h(), timeout=120).json()
    assert {c["finish_reason"] for c in forced["choices"]} == {"length"}
    assert forced["usage"]["completion_tokens"] == 8 * 96


def test_client_disconnect_aborts_a_non_streamed_request(tight):
    """A client that hangs up on a non-streamed completion frees the engine too: the server
    notices the closed connection while it waits for the answer and aborts the request."""
    before = _metric(tight, "cdlm_serve:request_success_total", 'finished_reason="abort"')
    tokens_before = _metric(tight, "cdlm_serve:request_generation_tokens_sum", "tiny")
    body = {"model": "tiny", "prompt": "a", "max_tokens": 450, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{tight}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _metric(tight, "cdlm_serve:request_success_total", 'finished_reason="abort"') > before:
            break
        time.sleep(0.1)
    aborted = _metric(tight, "cdlm_serve:request_success_total", 'finished_reason="abort"')
    assert aborted == before + 1  # counted as an abort, which it was
    generated = _metric(tight, "cdlm_serve:request_generation_tokens_sum", "tiny")
    assert 0 < generated - tokens_before < 450
    short = {"model": "tiny", "prompt": "b", "max_tokens": 3}
    assert httpx.post(f"{tight}/v1/completions", json=short).status_code == 200


def test_http_requests_are_counted_by_route_template_and_status(base):
    def count(route: str, status: str, method: str) -> float:
        for line in httpx.get(f"{base}/metrics").text.splitlines():
            if (
                line.startswith("cdlm_serve:http_requests_total{")
                and all(f'{k}="{v}"' in line for k, v in (("route", route), ("status", status)))
                and f'method="{method}"' in line
            ):
                return float(line.split()[-1])
        return 0.0

    ok = count("/v1/completions", "200", "POST")
    missing = count("/v1/sessions/{sid}", "404", "GET")
    nowhere = count("-", "404", "GET")
    denied = count("-", "401", "GET")
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json=body, headers=_h()).status_code == 200
    r = httpx.get(f"{base}/v1/sessions/no-such-session", headers=_h())
    assert r.status_code == 404
    assert httpx.get(f"{base}/v1/no/such/route/x1", headers=_h()).status_code == 404
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert count("/v1/completions", "200", "POST") == ok + 1
    # The route's template, not the id the client sent: a label cannot be blown up by clients.
    assert count("/v1/sessions/{sid}", "404", "GET") == missing + 1
    assert count("-", "404", "GET") == nowhere + 1 and count("-", "401", "GET") == denied + 1
    assert "no-such-session" not in httpx.get(f"{base}/metrics").text
    quota = next(
        line
        for line in httpx.get(f"{base}/metrics").text.splitlines()
        if line.startswith("cdlm_serve:session_disk_quota_bytes ")
    )
    assert float(quota.split()[-1]) == 20e9  # the default --sessions-disk-gb


def test_a_request_that_fails_inside_the_app_is_counted_as_a_500():
    """The 5xx alert reads http_requests_total: an exception that escapes the routes (answered
    500 by the outermost error handler) must be counted too."""
    from cdlm_serve.server.request_context import RequestContext

    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    counted: list[tuple[str, str, int]] = []
    middleware = RequestContext(broken, count=lambda *labels: counted.append(labels))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    with pytest.raises(RuntimeError):
        asyncio.run(middleware(scope, receive, send))
    assert counted == [("POST", "-", 500)]
