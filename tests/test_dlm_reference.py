"""Our diffusion models and decoders against the public reference code (LLaDA's generate.py,
Dream's generation_utils.py, Fast-dLLM's llada/generate.py), through golden outputs the
reference code produced on the same tiny checkpoints: tests/fixtures/dlm_reference/README.md
says how. Answers are compared token for token, and step counts exactly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny_models
from engine.dlm_engine import DLMEngine, DLMParams
from engine.unmasking import DREAM_ALGS, LLADA_REMASKING
from models.attention import AttentionPattern
from models.loading import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "dlm_reference"
GOLDEN = json.loads((FIXTURES / "cases.json").read_text())
MAKERS = {"dream": (tiny_models.dream_tiny, 1), "llada": (tiny_models.llada_tiny, 2)}


def _family(case: dict) -> str:
    return "dream" if case["name"].startswith("dream") else "llada"


CASES = GOLDEN["cases"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family, (make, seed) in MAKERS.items():
        folder = tmp_path_factory.mktemp(family)
        make(folder, seed=seed)
        digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        # The golden outputs belong to these exact weights: a changed tiny model is a stale
        # fixture, not a decoder bug.
        assert digest == GOLDEN["checkpoints"][family]["model.safetensors_sha256"]
        out[family] = folder
    return out


@pytest.fixture(scope="module")
def engines(folders) -> dict[str, DLMEngine]:
    out = {}
    for family, folder in folders.items():
        model, _ = load_model(folder)
        out[family] = DLMEngine(model, tiny_models.byte_tokenizer(), 512, max_batch=64)
    return out


def _params(case: dict) -> DLMParams:
    """The reference call as our request parameters."""
    call = case["call"]
    if case["source"].endswith("generation_utils_block.py"):  # Fast-dLLM's Dream decoder
        threshold = call["alg"] == "confidence_threshold"
        return DLMParams(
            max_tokens=call["max_new_tokens"],
            decoding="fast_dllm",
            block_size=call["block_length"],
            threshold=call["threshold"] if threshold else 0.0,
            steps=None if threshold else call["steps"],
            # The threshold path ranks by probability; the scheduled one always by entropy,
            # whatever `alg` says.
            confidence="probability" if threshold else "entropy",
            ignore_eos=True,
        )
    if _family(case) == "dream":
        n = call["max_new_tokens"]  # Dream has no blocks: one block of the whole answer
        return DLMParams(
            max_tokens=n,
            decoding="vanilla",
            block_size=n,
            steps=call["steps"],
            confidence=DREAM_ALGS[call["alg"]],
            alg_temp=call.get("alg_temp") or 0.0,
            seed=0 if call["alg"] == "origin" else None,  # the reference ran manual_seed(0)
            ignore_eos=True,  # the references never stop at end-of-text
        )
    scheduled = call.get("threshold") is None
    cached = case["function"] == "generate_with_prefix_cache"
    return DLMParams(
        max_tokens=call["gen_length"],
        decoding="fast_dllm" if cached else "vanilla",
        block_size=call["block_length"],
        threshold=call.get("threshold") or 0.0,
        steps=call["steps"] if scheduled else None,
        confidence=LLADA_REMASKING[call["remasking"]],
        seed=0 if call["remasking"] == "random" else None,  # the reference ran manual_seed(0)
        ignore_eos=True,
    )


def _reference_steps(case: dict) -> int:
    """Forward passes the reference decoder needed. Fast-dLLM's prefix-cache loop runs one
    more forward after a block's first pass already finished the block (it checks for masks
    only after the loop's forward); that pass changes nothing, and we do not run it."""
    wasted = case["function"] == "generate_with_prefix_cache"
    zero = sum(1 for n in case["unmasked_per_forward"] if n == 0) if wasted else 0
    return case["forward_count"] - zero


def _run_all(engine: DLMEngine, cases: list[dict]) -> dict[str, tuple[list[int], int]]:
    """Every case as one request, all in the engine at once (mixed batches)."""
    seqs = {}
    for case in cases:
        seq = engine.new_sequence(case["name"], case["prompt_ids"], _params(case))
        engine.add(seq)
        seqs[case["name"]] = seq
    answers: dict[str, list[int]] = {name: [] for name in seqs}
    steps: dict[str, int] = {}
    while engine.has_work():
        for out in engine.step():
            answers[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                steps[out.request_id] = out.steps
    return {name: (answers[name], steps[name]) for name in seqs}


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_forward_matches_reference_logits(engines, family):
    golden = load_file(FIXTURES / f"logits_{family}.safetensors")
    model = engines[family].model
    with torch.inference_mode():
        hidden = model(golden["input_ids"][None], pattern=AttentionPattern.bidirectional())
        ours = model.logits(hidden)[0].float()  # unshifted, as the reference model returns
    assert (ours - golden["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_decoder_reproduces_reference_alone(engines, case):
    engine = engines[_family(case)]
    outs = list(engine.generate(case["prompt_ids"], _params(case)))
    assert [t for o in outs for t in o.token_ids] == case["answer_ids"]
    assert outs[-1].steps == _reference_steps(case)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_decoders_reproduce_reference_in_one_mixed_batch(engines, family):
    cases = [c for c in CASES if _family(c) == family]
    got = _run_all(engines[family], cases)
    wrong = [c["name"] for c in cases if got[c["name"]] != (c["answer_ids"], _reference_steps(c))]
    assert not wrong
