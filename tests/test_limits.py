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


class _Model:
    """What `limits.prompt_ids` reads of a served model: one token per character, a BOS that
    starts a sequence, a 10-character text too long to tokenize."""

    max_model_len = 8
    vocab_size = 300

    def encode(self, text: str) -> list[int]:
        if len(text) > 10:
            raise ValueError(f"a prompt of {len(text)} characters cannot fit")
        return [ord(c) for c in text]

    def sequence_start(self, ids: list[int]) -> list[int]:
        return [1, *ids]


def test_a_prompt_becomes_checked_token_ids_in_one_place():
    model = _Model()
    assert limits.prompt_ids(model, "ab") == [1, 97, 98]  # a text starting a sequence
    assert limits.prompt_ids(model, "ab", start=False) == [97, 98]
    assert limits.prompt_ids(model, [5, 299]) == [5, 299]  # token ids, as they are
    long = limits.prompt_ids(model, "x" * 11, "messages")
    assert long == limits.LimitProblem(
        "a prompt of 11 characters cannot fit", "messages", "context_length_exceeded"
    )
    outside = limits.prompt_ids(model, [5, 300, -1])
    assert outside == limits.LimitProblem(
        "token id 300 is outside the vocabulary [0, 300)", "prompt"
    )
    # Stored whole (a session's prompt, a conversation to compact): it must leave a slot.
    assert limits.prompt_ids(model, list(range(7)), stored="prompt") == list(range(7))
    full = limits.prompt_ids(model, "abcdefg", "input", stored="the conversation")
    assert full == limits.LimitProblem(
        "the conversation of 8 tokens does not fit the model's context (8)",
        "input",
        "context_length_exceeded",
    )
    assert limits.prompt_ids(model, "abcdefg") == [1, *map(ord, "abcdefg")]  # an answer checks it
