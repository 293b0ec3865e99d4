"""The CUDA path (`pytest -m cuda`; `bench/gpu_check.py` runs it): every model family in bf16
on the device against an fp32 CPU reference, the AR and diffusion engines on the device against
the same engines on the CPU, the reference decoders' golden outputs on the device, and a
compaction. Skipped where there is no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tiny_models
from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models.loading import load_model
from test_dlm_reference import CASES, _params, _reference_steps

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
AR = ("llama", "qwen2", "qwen3", "gemma3")
DLM = {"dream": (tiny_models.dream_tiny, 1), "llada": (tiny_models.llada_tiny, 2)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for kind in AR:
        out[kind] = tmp_path_factory.mktemp(kind)
        tiny_models.hf_tiny(kind, out[kind])
    for kind, (make, seed) in DLM.items():
        out[kind] = tmp_path_factory.mktemp(kind)
        make(out[kind], seed=seed)
    return out


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", [*AR, *DLM])
def test_bf16_forward_on_cuda_matches_fp32_reference(folders, family):
    reference, _ = load_model(folders[family])
    model, _ = load_model(folders[family], device="cuda", dtype=torch.bfloat16)
    ids = _ids(48)
    with torch.inference_mode():
        want = reference.logits(reference(ids)).float()[0]  # [T, V]
        got = model.logits(model(ids.cuda())).float().cpu()[0]
    cosine = F.cosine_similarity(got, want, dim=-1)  # [T]
    assert cosine.min().item() > 0.99
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("family", AR)
def test_ar_engine_on_cuda_decodes_like_the_cpu(folders, family):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers = []
    for device in ("cpu", "cuda"):
        model, _ = load_model(folders[family], device=device)
        engine = AREngine(model, tiny_models.byte_tokenizer(), 512, max_batch=4)
        outs = engine.generate(_ids(20)[0].tolist(), params)
        answers.append([t for o in outs for t in o.token_ids])
    assert answers[0] == answers[1] and len(answers[0]) == 24


@pytest.fixture(scope="module")
def cuda_dlm(folders) -> dict[str, DLMEngine]:
    out = {}
    for family in DLM:
        model, _ = load_model(folders[family], device="cuda")
        out[family] = DLMEngine(model, tiny_models.byte_tokenizer(), 512, max_batch=64)
    return out


# The generator-driven cases (LLaDA's random remasking, Dream's origin) draw from a CUDA
# generator on the device, whose numbers differ from the CPU's: not comparable.
DEVICE_CASES = [c for c in CASES if "random" not in c["name"] and "origin" not in c["name"]]


@pytest.mark.parametrize("case", DEVICE_CASES, ids=[c["name"] for c in DEVICE_CASES])
def test_reference_decoders_reproduced_on_cuda(cuda_dlm, case):
    family = "dream" if case["name"].startswith("dream") else "llada"
    outs = list(cuda_dlm[family].generate(case["prompt_ids"], _params(case)))
    assert [t for o in outs for t in o.token_ids] == case["answer_ids"]
    assert outs[-1].steps == _reference_steps(case)


@pytest.mark.parametrize("decoding", ["cdlm", "fast_dllm", "vanilla"])
def test_bf16_diffusion_decoding_on_cuda(folders, decoding):
    model, _ = load_model(folders["llada"], device="cuda", dtype=torch.bfloat16)
    engine = DLMEngine(model, tiny_models.byte_tokenizer(), 512, max_batch=4)
    params = DLMParams(
        max_tokens=24, decoding=decoding, block_size=8, threshold=0.02, ignore_eos=True
    )
    outs = list(engine.generate(_ids(16)[0].tolist(), params))
    assert sum(len(o.token_ids) for o in outs) == 24
    assert outs[-1].finish_reason == "length"


def test_compaction_on_cuda_matches_the_cpu(folders):
    ids = _ids(400, seed=3)[0].tolist()
    errors = []
    for device in ("cpu", "cuda"):
        model, _ = load_model(folders["qwen2"], device=device)
        cache = model.new_cache(1, 512)
        with torch.inference_mode():
            model(torch.tensor([ids], device=device), cache=cache)  # causal prefill
        report = compact_row(
            model,
            cache,
            0,
            ids,
            CompactionSpec.exact(40, method="am-highest"),
            CompactionRuntime(tokenizer=tiny_models.byte_tokenizer()),
        )
        assert report.tokens_after == 40 and cache.lengths[0] == 40
        errors.append(report.output_error)
    assert errors[1] == pytest.approx(errors[0], rel=0.05, abs=1e-4)
