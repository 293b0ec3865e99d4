"""Diffusion models through the real HTTP server: /v1/completions, streaming, metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

import tiny_models
from cdlm_serve.engine.decoding.text_output import TextAssembler
from conftest import running_server, series_sum


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    dream = tmp_path_factory.mktemp("dream")
    tiny_models.dream_tiny(dream)
    llada = tmp_path_factory.mktemp("llada")
    tiny_models.llada_tiny(llada)
    with running_server(
        "--model",
        f"dream={dream}",
        "--model",
        f"llada={llada}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ) as url:
        yield url


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def _events(resp: httpx.Response) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


REQ = {"prompt": "The answer is", "max_tokens": 24, "block_size": 8, "threshold": 0.05}


@pytest.mark.parametrize("model", ["dream", "llada"])
def test_completion_reports_steps(base, model):
    body = _post(base, {"model": model, **REQ}).json()
    usage = body["usage"]
    assert usage["steps"] >= 1 + 3  # the prefill and at least one step per block
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    vanilla = _post(base, {"model": model, **REQ, "decoding": "vanilla"}).json()
    if vanilla["choices"][0]["finish_reason"] == "length":
        assert vanilla["usage"]["steps"] == 24  # one token per step, no prefill


def test_stream_sends_a_chunk_per_block(base):
    full = _post(base, {"model": "llada", **REQ}).json()
    r = _post(
        base, {"model": "llada", **REQ, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = _events(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == full["usage"]
    chunks = events[:-2]
    assert 1 <= len(chunks) <= 3  # at most one per block (24 tokens in blocks of 8)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_concurrent_requests_are_batched_and_unchanged(base):
    bodies = [
        {"model": "dream", "prompt": "alpha", "max_tokens": 16, "block_size": 8},
        {"model": "dream", "prompt": "a longer prompt here", "max_tokens": 12, "block_size": 4},
        {
            "model": "dream",
            "prompt": "gamma",
            "max_tokens": 16,
            "block_size": 8,
            "decoding": "fast_dllm",
        },
    ]
    alone = [_post(base, b).json()["choices"][0]["text"] for b in bodies]

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(
                *(client.post(f"{base}/v1/completions", json=b) for b in bodies)
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone


def test_openai_client_with_extra_body(base):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    out = client.completions.create(
        model="dream", prompt="Hi", max_tokens=8, extra_body={"block_size": 4, "decoding": "cdlm"}
    )
    assert out.usage.model_extra["steps"] >= 3
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="dream", prompt="Hi", max_tokens=8, stream=True, extra_body={"block_size": 4}
        )
    )
    assert text == out.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"block_size": 0}, "block_size"),
        ({"decoding": "magic"}, "decoding"),
        ({"threshold": -0.5}, "threshold"),
        ({"max_tokens": 500, "block_size": 64}, "max_tokens"),
    ],
)
def test_bad_diffusion_options(base, extra, param):
    r = _post(base, {"model": "dream", "prompt": "x", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_metrics_expose_dlm_series(base):
    _post(base, {"model": "llada", **REQ})
    text = httpx.get(f"{base}/metrics").text
    for series in (
        "cdlm_serve:dlm_steps_per_request_bucket",
        "cdlm_serve:dlm_tokens_per_step_bucket",
        "cdlm_serve:dlm_steps_per_block_bucket",
        "cdlm_serve:dlm_e2e_request_latency_seconds_bucket",
        "cdlm_serve:dlm_step_latency_seconds_bucket",
        "cdlm_serve:request_success_total",
        "cdlm_serve:generation_tokens_total",
    ):
        assert series in text, series
    count = next(
        line
        for line in text.splitlines()
        if line.startswith("cdlm_serve:dlm_steps_per_request_count")
        and 'model_name="llada"' in line
        and 'decoding="cdlm"' in line
    )
    assert float(count.split()[-1]) >= 1


GOLDEN = json.loads(
    (Path(__file__).parent / "fixtures" / "dlm_reference" / "cases.json").read_text()
)["cases"]

# Reference runs asked for with the options users of those releases know (extra body).
RELEASE_OPTIONS = {
    "dream_entropy_p1_s8_topkNone": {"steps": 8, "alg": "entropy", "block_size": 16},
    "dream_topk_margin_p2_s16_topkNone": {"steps": 16, "alg": "topk_margin", "block_size": 16},
    "dream_origin_p1_s8_topkNone_seed0": {"steps": 8, "alg": "origin", "block_size": 16, "seed": 0},
    "llada_orig_p2_g16_b8_s8_lowconf": {"steps": 8, "remasking": "low_confidence", "block_size": 8},
    "llada_orig_p1_g16_b8_s16_random_seed0": {
        "steps": 16,
        "remasking": "random",
        "block_size": 8,
        "seed": 0,
    },
    "fastdllm_llada_generate_with_prefix_cache_p1_b4_thr0.018": {
        "decoding": "fast_dllm",
        "block_size": 4,
        "threshold": 0.018,
    },
}


@pytest.mark.parametrize("name", list(RELEASE_OPTIONS))
def test_release_options_reproduce_the_reference_decoders(base, name):
    case = next(c for c in GOLDEN if c["name"] == name)
    model = "dream" if name.startswith("dream") else "llada"
    body = {"model": model, "prompt": case["prompt_ids"], "max_tokens": 16, "ignore_eos": True}
    got = _post(base, {**body, **RELEASE_OPTIONS[name]}).json()
    text = TextAssembler(tiny_models.byte_tokenizer(), [])
    expected = "".join(text.push(t).text for t in case["answer_ids"]) + text.flush()
    assert got["choices"][0]["text"] == expected
    assert got["usage"]["completion_tokens"] == 16
    if "steps" in RELEASE_OPTIONS[name]:
        assert got["usage"]["steps"] == case["forward_count"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"steps": 3, "block_size": 8}, "steps"),  # 2 blocks: not a multiple
        ({"steps": 32, "block_size": 8}, "steps"),  # more steps than answer tokens
        ({"alg": "entropy", "remasking": "random"}, "alg"),
        ({"alg": "fastest"}, "alg"),
        ({"alg_temp": -1}, "alg_temp"),
    ],
)
def test_bad_release_options_get_a_clear_400(base, extra, param):
    r = _post(base, {"model": "llada", "prompt": "a", "max_tokens": 16, **extra})
    assert r.status_code == 400
    assert param in json.dumps(r.json()["error"])


def test_steps_per_block_histogram_counts_each_block(base):
    """16 tokens in blocks of 8 on a fixed schedule of 8 steps: two blocks of 4 steps each."""
    labels = ('model_name="llada"', 'decoding="vanilla"')
    count = series_sum(base, "cdlm_serve:dlm_steps_per_block_count", *labels)
    total = series_sum(base, "cdlm_serve:dlm_steps_per_block_sum", *labels)
    body = {"model": "llada", "prompt": "a", "max_tokens": 16, "ignore_eos": True}
    r = _post(base, {**body, "block_size": 8, "steps": 8, "decoding": "vanilla"})
    assert r.status_code == 200 and r.json()["usage"]["steps"] == 8
    assert series_sum(base, "cdlm_serve:dlm_steps_per_block_count", *labels) == count + 2
    assert series_sum(base, "cdlm_serve:dlm_steps_per_block_sum", *labels) == total + 8


def test_vllm_diffusion_counters_count_steps_and_committed_tokens(base):
    """vLLM's names: 16 tokens in blocks of 8 on a fixed schedule of 8 steps, to the end
    (ignore_eos): 8 denoising steps that commit all 16 answer positions."""
    label = 'model_name="llada"'
    steps = series_sum(base, "cdlm_serve:diffusion_num_denoising_steps_total", label)
    committed = series_sum(base, "cdlm_serve:diffusion_num_committed_tokens_total", label)
    body = {"model": "llada", "prompt": "a", "max_tokens": 16, "ignore_eos": True}
    r = _post(base, {**body, "block_size": 8, "steps": 8, "decoding": "vanilla"})
    assert r.status_code == 200 and r.json()["usage"]["steps"] == 8
    assert series_sum(base, "cdlm_serve:diffusion_num_denoising_steps_total", label) == steps + 8
    committed_now = series_sum(base, "cdlm_serve:diffusion_num_committed_tokens_total", label)
    assert committed_now == committed + 16
