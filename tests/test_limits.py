"""The limits a request must fit (engine/limits.py), the one place the server and the engines
read them from."""

from __future__ import annotations

import torch

import tiny_models
from cdlm_serve.engine import limits
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models.loading import load_model


def test_an_ar_request_past_the_context_is_refused_or_clamped():
    assert limits.ar_problem(10, 6, 0, 16) is None
    refused = limits.ar_problem(10, 7, 0, 16)
    assert refused is not None and refused.param == "max_tokens"
    assert refused.code == "context_length_exceeded" and "17 tokens" in refused.message
    assert limits.ar_problem(10, 7, 0, 16, clamp=True) is None  # the engine's way
    assert limits.ar_problem(10, None, 5, 16) is None  # the rest of the context: 1 token
    full = limits.ar_problem(10, None, 6, 16, clamp=True)  # a session left no room
    assert full is not None and full.code == "context_length_exceeded"
    empty = limits.ar_problem(0, 4, 0, 16)
    assert empty is not None and empty.param == "prompt"


def test_a_diffusion_answer_is_whole_blocks_and_its_steps_divide_them():
    assert limits.dlm_answer_length(9, 8) == 16
    assert limits.dlm_problem(40, 20, 8, None, 64) is None  # 40 + 24 = 64
    rounded = limits.dlm_problem(41, 20, 8, None, 64)  # 20 fits, 24 (3 blocks) does not
    assert rounded is not None and "rounded up to whole blocks" in rounded.message
    steps = limits.dlm_problem(8, 16, 8, 3, 64)  # 3 steps over 2 blocks
    assert steps is not None and steps.param == "steps"
    assert limits.dlm_problem(8, 16, 8, 4, 64) is None
    assert limits.dlm_problem(8, 16, 0, None, 64).param == "block_size"  # type: ignore[union-attr]


def test_the_ar_engine_clamps_an_answer_to_the_context(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, dtype=torch.float32)
    engine = AREngine(model, tiny_models.byte_tokenizer(), max_model_len=24)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    outs = list(engine.generate(list(range(3, 19)), params))  # 16 prompt tokens
    assert sum(len(o.token_ids) for o in outs) == 8 and outs[-1].finish_reason == "length"
