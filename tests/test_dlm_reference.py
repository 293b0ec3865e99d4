"""Our diffusion models and decoders against the public reference code (LLaDA's generate.py,
Dream's generation_utils.py, Fast-dLLM's llada/generate.py), through golden outputs the
reference code produced on the same tiny checkpoints (tests/fixtures/dlm_reference/
make_fixtures.py regenerates them; its README says how and what the cases are). Answers are
compared token for token, and step counts exactly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny_models
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
from cdlm_serve.engine.decoding.unmasking import DREAM_ALGS, LLADA_REMASKING
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "dlm_reference"
GOLDEN = json.loads((FIXTURES / "cases.json").read_text())
# The checkpoints the golden outputs were made on (make_fixtures.py CHECKPOINTS): two nearly
# uniform ones, and two "peaked" ones whose confident, varied predictions make a wrong decoder
# choose differently.
MAKERS = {
    "dream": (tiny_models.dream_tiny, 1),
    "llada": (tiny_models.llada_tiny, 2),
    "dream_peaked": (tiny_models.dream_peaked, 3),
    "llada_peaked": (tiny_models.llada_peaked, 4),
}
CASES = GOLDEN["cases"]
# How near a tie a case's decisions may come (make_fixtures.py MIN_GAP*): far above what our
# fp32 logits' difference from the reference's can move a confidence.
MIN_GAP = {"dream": 1e-6, "llada": 1e-6, "dream_peaked": 1e-4, "llada_peaked": 1e-4}


def _family(case: dict) -> str:
    return GOLDEN["checkpoints"][case["checkpoint"]]["family"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    assert set(MAKERS) == set(GOLDEN["checkpoints"])
    out = {}
    for name, (make, seed) in MAKERS.items():
        folder = tmp_path_factory.mktemp(name)
        make(folder, seed=seed)
        digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        # The golden outputs belong to these exact weights: a changed tiny model is a stale
        # fixture, not a decoder bug.
        assert digest == GOLDEN["checkpoints"][name]["model.safetensors_sha256"]
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def engines(folders) -> dict[str, DLMEngine]:
    out = {}
    for name, folder in folders.items():
        model, _ = load_model(folder)
        out[name] = DLMEngine(model, tiny_models.byte_tokenizer(), 512, max_batch=64)
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
            seed=case.get("seed"),  # origin: the reference ran torch.manual_seed(seed)
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
        seed=case.get("seed"),  # random: the reference ran torch.manual_seed(seed)
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


def test_cases_are_decisive():
    """Every case decides something no fp32 rounding can flip, and the peaked checkpoints'
    cases include uneven LLaDA schedules and forwards that finalize several tokens by
    threshold (what the nearly uniform checkpoints could not show)."""
    for case in CASES:
        gap = case["min_gap"]
        assert gap is None or gap >= MIN_GAP[case["checkpoint"]], case["name"]
    peaked = [c for c in CASES if c["checkpoint"].endswith("_peaked")]
    assert any(c["unmasked_per_forward"][:3] == [3, 3, 2] for c in peaked)
    several = [
        c for c in peaked if c["call"].get("threshold") and max(c["unmasked_per_forward"]) > 1
    ]
    assert {c["checkpoint"] for c in several} == {"dream_peaked", "llada_peaked"}


@pytest.mark.parametrize("checkpoint", list(MAKERS))
def test_forward_matches_reference_logits(engines, checkpoint):
    golden = load_file(FIXTURES / f"logits_{checkpoint}.safetensors")
    model = engines[checkpoint].model
    with torch.inference_mode():
        hidden = model(golden["input_ids"][None], pattern=AttentionPattern.bidirectional())
        ours = model.logits(hidden)[0].float()  # unshifted, as the reference model returns
    assert (ours - golden["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_decoder_reproduces_reference_alone(engines, case):
    engine = engines[case["checkpoint"]]
    outs = list(engine.generate(case["prompt_ids"], _params(case)))
    assert [t for o in outs for t in o.token_ids] == case["answer_ids"]
    assert outs[-1].steps == _reference_steps(case)


@pytest.mark.parametrize("checkpoint", list(MAKERS))
def test_decoders_reproduce_reference_in_one_mixed_batch(engines, checkpoint):
    cases = [c for c in CASES if c["checkpoint"] == checkpoint]
    got = _run_all(engines[checkpoint], cases)
    wrong = [c["name"] for c in cases if got[c["name"]] != (c["answer_ids"], _reference_steps(c))]
    assert not wrong
