"""bench/dlm.py's text runs compare equal work: every decoder writes the same answer length."""

from __future__ import annotations

import argparse

import tiny_models
from cdlm_serve.bench import cdlm_suites
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine
from cdlm_serve.models.loading import load_model


def test_text_runs_give_every_decoder_the_same_answer_length(tmp_path):
    tiny_models.llada_tiny(tmp_path)
    model, _ = load_model(tmp_path)
    engine = DLMEngine(model, tiny_models.byte_tokenizer(), 512, max_batch=1)
    # Every token ends the text: without ignore_eos each answer would stop at once.
    engine.eos_token_ids = frozenset(range(tiny_models.VOCAB))
    # Threshold 0: cdlm finishes a block per step.
    args = argparse.Namespace(max_tokens=24, block_size=8, threshold=0.0)
    rows = [cdlm_suites.Row(d, engine, d) for d in ("vanilla", "fast_dllm", "cdlm")]
    fastest, same = cdlm_suites.both_paths(rows, ["hello there", "once upon"], args)
    for name, done in fastest.items():
        assert [tokens for _, _, tokens, _ in done] == [24, 24], name
        assert same[name]["tok_s"] > 0
        assert [text for *_, text in done] == ["", ""]  # scored up to the first end-of-text
    assert fastest["vanilla"][0][1] == 24  # one token per step
    assert fastest["cdlm"][0][1] == 1 + 3  # the prefill, then one step per block
