"""The HTTP server, started for real (uvicorn on a free port) with a tiny model."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from conftest import app_in_thread, running_server


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    with running_server(
        "--model", f"tiny={tiny_llama_dir}", "--device", "cpu", "--dtype", "float32"
    ) as url:
        yield url


def _post(base: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60, **kw)


def _sse(resp: httpx.Response) -> list:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_and_models(base):
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    models = httpx.get(f"{base}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        ("tiny", "model", 512)
    ]


def test_completion_shape_and_usage(base):
    r = _post(base, {"model": "tiny", "prompt": "Hello", "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == 5  # byte tokenizer: one token per byte
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_stream_equals_non_stream(base):
    req = {"model": "tiny", "prompt": "abc", "max_tokens": 12, "temperature": 0}
    full = _post(base, req).json()
    r = _post(base, {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_prompt_forms_n_echo_and_seed(base):
    text = _post(base, {"model": "tiny", "prompt": "xy", "max_tokens": 4, "temperature": 0})
    ids = _post(base, {"model": "tiny", "prompt": [120, 121], "max_tokens": 4, "temperature": 0})
    assert text.json()["choices"][0]["text"] == ids.json()["choices"][0]["text"]
    many = _post(
        base, {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3, "n": 2, "seed": 11}
    ).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    again = _post(
        base, {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3, "n": 2, "seed": 11}
    ).json()
    assert [c["text"] for c in many["choices"]] == [c["text"] for c in again["choices"]]
    assert many["usage"]["prompt_tokens"] == 2  # each prompt counted once
    echo = _post(
        base, {"model": "tiny", "prompt": "xy", "max_tokens": 4, "temperature": 0, "echo": True}
    ).json()
    assert echo["choices"][0]["text"] == "xy" + text.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x", "temperature": 2.5}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny", "prompt": 5}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "tiny", "prompt": [], "max_tokens": 2}, 400, "prompt"),
        ({"model": "tiny", "prompt": [999999]}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "decoding": "cdlm"}, 400, "decoding"),
        ([1, 2, 3], 400, None),
    ],
)
def test_bad_requests_get_openai_errors(base, body, status, param):
    r = _post(base, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_malformed_json_and_unknown_routes(base):
    r = httpx.post(
        f"{base}/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/nothing").status_code == 404
    r = httpx.get(f"{base}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client(base):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.usage.prompt_tokens == 2
    streamed = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    from openai import BadRequestError, NotFoundError

    with pytest.raises(NotFoundError):
        client.completions.create(model="missing", prompt="Hi")
    with pytest.raises(BadRequestError):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=0)


def test_health_is_503_while_models_load(tmp_path):
    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ModelSpec, ServerSettings

    release = threading.Event()

    def slow_loader(state):
        release.wait(30)
        state.ready.set()

    settings = ServerSettings(
        [ModelSpec("x", "x")], torch.device("cpu"), torch.float32, sessions_dir=tmp_path
    )
    with app_in_thread(create_app(settings, slow_loader), healthy_within=None) as base:
        try:
            r = httpx.get(f"{base}/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = _post(base, {"model": "x", "prompt": "y"})
            assert r.status_code == 503 and r.headers["retry-after"]
            release.set()
            time.sleep(0.2)
            assert httpx.get(f"{base}/health").status_code == 200
        finally:
            release.set()


def test_app_in_thread_fails_when_health_never_answers_200(tmp_path):
    """conftest's app_in_thread hands out a URL only once /health answers 200: a server that
    never gets there fails in the helper, with what /health said (not in the test's first
    request, with a 503 that says nothing of why)."""
    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ModelSpec, ServerSettings

    never = threading.Event()
    settings = ServerSettings(
        [ModelSpec("x", "x")], torch.device("cpu"), torch.float32, sessions_dir=tmp_path
    )
    app = create_app(settings, lambda state: never.wait(30))  # loads forever: 503
    try:
        with (
            pytest.raises(RuntimeError, match=r"did not answer 200 within 0\.5 s.*loading"),
            app_in_thread(app, healthy_within=0.5),
        ):
            pytest.fail("app_in_thread yielded a server whose /health never answered 200")
    finally:
        never.set()


def _prefix_counters(base: str) -> tuple[float, float]:
    found = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        for name in ("queries", "hits"):
            if line.startswith(f'cdlm_serve:prefix_cache_{name}_total{{model_name="tiny"}}'):
                found[name] = float(line.split()[-1])
    return found.get("queries", -1.0), found.get("hits", -1.0)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(base):
    """The second request with the same 100-token prompt loads 96 of them (6 full blocks; the
    last token always runs) and answers the same; usage and vLLM's counters say so."""
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(100))  # 100 byte tokens, unique here
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    q0, h0 = _prefix_counters(base)
    first = _post(base, body).json()
    second = _post(base, {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [e for e in _sse(second) if e != "[DONE]"]
    q1, h1 = _prefix_counters(base)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == first["choices"][0]["text"]
    assert (q1 - q0, h1 - h0) == (200, 96)


def test_no_prefix_caching_prefills_every_prompt(tiny_llama_dir):
    args = ("--device", "cpu", "--dtype", "float32", "--no-prefix-caching")
    with running_server("--model", f"tiny={tiny_llama_dir}", *args) as url:
        body = {"model": "tiny", "prompt": "x" * 80, "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            usage = _post(url, body).json()["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        assert "prefix_cache_queries_total{" not in httpx.get(f"{url}/metrics").text


def test_memory_gauges_say_what_holds_memory(base):
    """The process's RSS, and the engine's batch cache in bytes: after a request the tiny
    model's cache is 8 rows x 256 slots x (K, V) x 2 layers x 2 KV heads x 16 x fp32."""
    assert _post(base, {"model": "tiny", "prompt": "memory", "max_tokens": 2}).status_code == 200
    samples = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(("process_resident_memory_bytes ", "cdlm_serve:kv_cache_bytes{")):
            samples[line.split()[0]] = float(line.split()[-1])
    assert samples['cdlm_serve:kv_cache_bytes{model_name="tiny"}'] == 8 * 256 * 2 * 2 * 2 * 16 * 4
    assert samples["process_resident_memory_bytes"] > 50e6


def test_a_salted_request_does_not_reuse_an_unsalted_prefix(base):
    prompt = "".join(chr(97 + (i * 11) % 26) for i in range(80))  # unique in this module
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    details = [
        _post(base, {**body, **extra}).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        for extra in ({}, {"cache_salt": "tenant"}, {"cache_salt": "tenant"}, {})
    ]
    assert details == [0, 0, 64, 64]
    bad = _post(base, {**body, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
