"""The diffusion decoding engine on tiny random Dream- and LLaDA-format models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tiny_models
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from conftest import outputs_by_request


@pytest.fixture(scope="module")
def engine(tiny_dlm_engine):
    return tiny_dlm_engine


def _prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def _run(engine: DLMEngine, prompt: list[int], **kw):
    outs = list(engine.generate(prompt, DLMParams(**kw)))
    ids = [t for o in outs for t in o.token_ids]
    return ids, "".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].steps, outs


def _reference_block_logits(engine, seq, pattern) -> torch.Tensor:
    """Full recompute of prompt + answer so far (masks included) under `pattern`."""
    model = engine.model
    p, start, size = len(seq.prompt), seq.block_start, seq.block_size
    upto = p + start + size if pattern.kind == "block_causal" else p + seq.gen_len
    ids = torch.cat([torch.tensor(seq.prompt), seq.answer])[:upto]
    logits = model.token_logits(model(ids[None], pattern=pattern))[0]
    return logits[p + start : p + start + size].float()


@pytest.mark.parametrize("threshold", [0.02, 0.9])
def test_cdlm_step_logits_equal_full_block_causal_recompute(engine, threshold):
    diffs = []

    def check(seq, logits):
        pattern = AttentionPattern.block_causal(seq.block_size, len(seq.prompt))
        diffs.append((logits - _reference_block_logits(engine, seq, pattern)).abs().max().item())

    engine.on_step = check
    try:
        _run(engine, _prompt(11), max_tokens=24, block_size=8, threshold=threshold, ignore_eos=True)
    finally:
        engine.on_step = None
    assert len(diffs) >= 3 and max(diffs) <= 1e-4


def test_fast_dllm_refresh_passes_are_exact(engine):
    """Fast-dLLM's cache is approximate within a block, but each block's first pass is a full
    bidirectional recompute."""
    diffs = []

    def check(seq, logits):
        block = seq.answer[seq.block_start : seq.block_start + seq.block_size]
        if bool((block == engine.mask_id).all()):  # first step of the block
            ref = _reference_block_logits(engine, seq, AttentionPattern.bidirectional())
            diffs.append((logits - ref).abs().max().item())

    engine.on_step = check
    try:
        _run(
            engine,
            _prompt(9),
            max_tokens=16,
            block_size=8,
            decoding="fast_dllm",
            threshold=0.05,
            ignore_eos=True,
        )
    finally:
        engine.on_step = None
    assert len(diffs) == 2 and max(diffs) <= 1e-4


def _count_forwards(engine, fn):
    before = engine.forward_passes
    result = fn()
    return engine.forward_passes - before, result


@pytest.mark.parametrize("decoding", ["cdlm", "fast_dllm", "vanilla"])
def test_reported_steps_are_forward_passes(engine, decoding):
    passes, (ids, _, finish, steps, _) = _count_forwards(
        engine,
        lambda: _run(
            engine,
            _prompt(7),
            max_tokens=16,
            block_size=8,
            decoding=decoding,
            threshold=0.05,
            ignore_eos=True,
        ),
    )
    assert steps == passes and len(ids) == 16 and finish == "length"


def test_vanilla_takes_one_step_per_token(engine):
    _, _, _, steps, outs = _run(
        engine, _prompt(5), max_tokens=24, block_size=8, decoding="vanilla", ignore_eos=True
    )
    assert steps == 24
    assert [o.steps for o in outs] == [8, 16, 24]  # one chunk per completed block


def test_threshold_extremes(engine):
    # tau > 1: never confident enough, so exactly one token per step (+1 for the prefill).
    _, _, _, steps, _ = _run(
        engine, _prompt(6), max_tokens=16, block_size=8, threshold=1.5, ignore_eos=True
    )
    assert steps == 16 + 1
    # tau = 0: every masked token is final after one pass, so one step per block.
    _, _, _, steps, _ = _run(
        engine, _prompt(6), max_tokens=32, block_size=8, threshold=0.0, ignore_eos=True
    )
    assert steps == 4 + 1


def test_max_tokens_is_exact_when_not_a_whole_block(engine):
    ids, text, finish, _, _ = _run(
        engine, _prompt(6), max_tokens=13, block_size=8, threshold=0.0, ignore_eos=True
    )
    assert len(ids) == 13 and finish == "length"
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("decoding", ["cdlm", "fast_dllm", "vanilla"])
def test_end_of_text_inside_a_block_ends_the_answer(engine, decoding):
    kw = {"max_tokens": 24, "block_size": 8, "decoding": decoding, "threshold": 0.05}
    full, _, _, _, _ = _run(engine, _prompt(8, seed=3), ignore_eos=True, **kw)
    eot = full[11]  # a token in the middle of the second block
    cut = full.index(eot)
    ids, text, finish, _, _ = _run(
        engine, _prompt(8, seed=3), stop_token_ids=[eot], ignore_eos=True, **kw
    )
    assert finish == "stop"
    assert ids == full[: cut + 1]  # the stop token is counted, nothing after it is returned
    assert text == engine.tokenizer.decode(full[:cut], skip_special_tokens=True)


@pytest.mark.parametrize("decoding", ["cdlm", "fast_dllm", "vanilla"])
def test_batched_requests_decode_as_if_alone(engine, decoding):
    reqs = [
        (
            _prompt(5, 1),
            DLMParams(
                max_tokens=16, block_size=8, decoding=decoding, threshold=0.05, ignore_eos=True
            ),
        ),
        (
            _prompt(13, 2),
            DLMParams(
                max_tokens=11, block_size=4, decoding=decoding, threshold=0.05, ignore_eos=True
            ),
        ),
        (
            _prompt(9, 3),
            DLMParams(
                max_tokens=24, block_size=8, decoding=decoding, threshold=0.05, ignore_eos=True
            ),
        ),
    ]
    alone = []
    for prompt, params in reqs:
        outs = list(engine.generate(prompt, params))
        alone.append(([t for o in outs for t in o.token_ids], outs[-1].steps))
    got: dict[str, list[int]] = {}
    steps: dict[str, int] = {}
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, (p, params) in enumerate(reqs)]
    engine.add(seqs[0])
    engine.add(seqs[1])
    n_steps = 0
    while engine.has_work():
        if n_steps == 3:
            engine.add(seqs[2])  # joins a running batch between steps
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            steps[out.request_id] = out.steps
        n_steps += 1
    assert [(got[f"r{i}"], steps[f"r{i}"]) for i in range(3)] == alone


def test_sampling_is_seeded(engine):
    kw = {"max_tokens": 16, "block_size": 8, "temperature": 1.0, "ignore_eos": True}
    a = _run(engine, _prompt(6), seed=5, **kw)[0]
    b = _run(engine, _prompt(6), seed=5, **kw)[0]
    c = _run(engine, _prompt(6), seed=6, **kw)[0]
    assert a == b and a != c


def test_context_limit_is_checked(engine):
    with pytest.raises(ValueError, match="maximum context length is 512"):
        engine.new_sequence("x", _prompt(500), DLMParams(max_tokens=20, block_size=8))


def test_the_engine_makes_its_own_params_from_a_requests_options(engine):
    from cdlm_serve.engine import limits
    from cdlm_serve.engine.decoding import GenerationOptions

    plain = engine.params(GenerationOptions(stop=("x",), seed=1), 20, 7)
    assert plain == DLMParams(
        max_tokens=20,
        temperature=0.0,  # greedy unless the request sets a temperature
        seed=7,
        stop=["x"],
        decoding="cdlm",
        block_size=engine.block_size,
        threshold=engine.threshold,
    )
    reference = engine.params(GenerationOptions(steps=4, alg="entropy", temperature=0.5), 20, 7)
    assert (reference.decoding, reference.confidence, reference.temperature) == (
        "vanilla",  # the reference releases' options mean their decoder
        "entropy",
        0.5,
    )
    assert engine.params(GenerationOptions(remasking="random"), 20, None).confidence == "random"
    with pytest.raises(limits.LimitError) as e:
        engine.params(GenerationOptions(alg="entropy", remasking="random"), 20, None)
    assert e.value.problem.param == "alg" and "alternatives" in str(e.value)
    with pytest.raises(limits.LimitError) as e:
        engine.params(GenerationOptions(alg="fastest"), 20, None)
    assert e.value.problem.param == "alg"
    blocks = engine.params(GenerationOptions(block_size=16), 20, None)  # 32 tokens decoded
    assert engine.problem(480, blocks) is None
    rounded = engine.problem(481, blocks)
    assert rounded is not None and "rounded up to whole blocks" in rounded.message
    assert engine.prefix_cache is None  # no prefix caching on a diffusion engine


@pytest.mark.parametrize("decoding", ["cdlm", "fast_dllm", "vanilla"])
def test_a_model_that_predicts_the_mask_token_still_finishes(tmp_path, decoding):
    tiny_models.llada_tiny(tmp_path)
    model, _ = load_model(tmp_path)
    with torch.no_grad():
        model.lm_head.weight[tiny_models.MASK_ID] += 5.0  # the mask id wins every argmax
    engine = DLMEngine(model, tiny_models.byte_tokenizer(), max_model_len=512)
    params = DLMParams(max_tokens=16, block_size=8, decoding=decoding, ignore_eos=True)
    engine.add(engine.new_sequence("r", _prompt(5), params))
    outs = []
    for _ in range(40):  # bounded: a regression must fail, not hang
        outs += engine.step()
        if not engine.has_work():
            break
    ids = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason == "length" and len(ids) == 16
    assert tiny_models.MASK_ID not in ids and outs[-1].steps <= 16 + 1


@pytest.mark.parametrize("decoding", ["cdlm", "fast_dllm", "vanilla"])
def test_long_requests_joining_mid_answer_fit_the_cache(engine, decoding):
    # A late joiner's first pass (fast_dllm: prompt + whole answer) is padded onto rows that
    # already hold most of their answer: the shared cache must fit the longest row + q_max.
    # (It used to be sized per row only: "the view grew its own buffers".)
    reqs = [(_prompt(40, s), 40) for s in (4, 5, 6)]
    params = [
        DLMParams(max_tokens=n, block_size=8, decoding=decoding, threshold=0.9, ignore_eos=True)
        for _, n in reqs
    ]
    alone = [
        [t for o in engine.generate(p, par) for t in o.token_ids]
        for (p, _), par in zip(reqs, params, strict=True)
    ]
    seqs = [
        engine.new_sequence(f"r{i}", p, par)
        for i, ((p, _), par) in enumerate(zip(reqs, params, strict=True))
    ]
    got: dict[str, list[int]] = {}
    engine.add(seqs[0])
    for n_steps in range(10_000):
        if n_steps in (9, 17):
            engine.add(seqs[1 if n_steps == 9 else 2])
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        if not engine.has_work():
            break
    assert [got[f"r{i}"] for i in range(3)] == alone


def test_a_full_mode_does_not_hold_back_other_modes(engine):
    """max_batch rows per mode: a request of a mode with room starts at once, even behind one
    that waits for its full mode (no head-of-line blocking)."""
    engine.scheduler.max_batch = 1
    try:
        params = {"max_tokens": 16, "block_size": 8, "ignore_eos": True}
        first = engine.new_sequence("a", _prompt(5), DLMParams(decoding="cdlm", **params))
        second = engine.new_sequence("b", _prompt(5, 1), DLMParams(decoding="cdlm", **params))
        other = engine.new_sequence("c", _prompt(5, 2), DLMParams(decoding="vanilla", **params))
        for seq in (first, second, other):
            engine.add(seq)
        engine.step()
        assert engine.running["cdlm"] == [first] and engine.running["vanilla"] == [other]
        assert engine.waiting == [second]
        while engine.has_work():
            engine.step()
        assert {s.finish_reason for s in (first, second, other)} == {"length"}
    finally:
        engine.scheduler.max_batch = 8


@pytest.mark.parametrize("decoding", ["cdlm", "vanilla"])
def test_a_stop_string_mid_block_counts_only_what_was_returned(engine, decoding):
    tok = engine.tokenizer
    params = {"max_tokens": 32, "block_size": 16, "decoding": decoding, "ignore_eos": True}
    for seed in range(20):
        ids, _, _, _, _ = _run(engine, _prompt(7, seed), **params)
        # A printable character first completed by a token in the middle of a block.
        for k in range(1, len(ids)):
            char = tok.decode(ids[: k + 1], skip_special_tokens=True)[-1:]
            before = tok.decode(ids[:k], skip_special_tokens=True)
            if k % 16 in (0, 15) or not char.isalnum() or char in before:
                continue
            got_ids, got_text, reason, _, _ = _run(engine, _prompt(7, seed), **params, stop=[char])
            assert reason == "stop" and got_text == before
            assert got_ids == ids[: k + 1]  # not the whole 16-token block
            return
    pytest.skip("no usable stop character in 20 random answers")


def test_cdlm_prompts_joining_together_prefill_in_one_forward(engine):
    params = DLMParams(max_tokens=16, block_size=8, decoding="cdlm", ignore_eos=True)
    alone = [_run(engine, _prompt(n, n), **dataclasses.asdict(params))[0] for n in (3, 9, 6)]
    before = engine.forward_passes
    seqs = [engine.new_sequence(str(n), _prompt(n, n), params) for n in (3, 9, 6)]
    for seq in seqs:
        engine.add(seq)
    outs: dict[str, list[int]] = {s.id: [] for s in seqs}
    for out in engine.step():
        outs[out.request_id] += out.token_ids
    assert engine.forward_passes - before == 2  # one prefill for the three, one block step
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id] += out.token_ids
    assert [outs[str(n)] for n in (3, 9, 6)] == alone


@pytest.mark.parametrize("temperature", [1e-30, 5e-324, 0.5])
def test_drawn_positions_are_k_candidates_whatever_the_temperature(temperature):
    """Dream's alg_temp draws the scheduled positions by confidence: any temperature a request
    may send draws exactly k distinct candidates (never a finalized position), never fails."""
    from cdlm_serve.engine.decoding.unmasking import pick

    conf = torch.tensor([0.9, float("-inf"), 0.1, 0.5, float("-inf"), 0.0003, 0.2])
    gen = torch.Generator().manual_seed(0)
    for k in (1, 3, 5):
        chosen = pick(conf, k, temperature, gen)
        assert int(chosen.sum()) == k and not chosen[1] and not chosen[4]


def test_rows_finishing_in_the_same_step_each_finish_once(engine):
    """vanilla finalizes one token a step: three requests of 4 tokens finish in the same step,
    and each sends its 4 tokens and one finish, its last output (a retire that skipped a moved
    row ran it again: a second "length" output)."""
    params = DLMParams(max_tokens=4, block_size=4, decoding="vanilla", ignore_eos=True)
    prompts = [_prompt(5, s) for s in range(3)]
    alone = [[t for o in engine.generate(p, params) for t in o.token_ids] for p in prompts]
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outs = outputs_by_request(engine, seqs)
    for i, seq in enumerate(seqs):
        got = outs[seq.id]
        assert [o.finish_reason for o in got] == ["length"], seq.id
        assert got[0].token_ids == alone[i] and got[0].steps == 4


def test_aborting_rows_that_are_not_the_last_leaves_the_others_answers_whole(engine):
    """Of four rows of one mode, the first and the last abort in the same step: each sends one
    "abort" and runs no step after its client left, and the rows that stay (their cache rows
    moved into the freed ones) answer as they would alone."""
    params = DLMParams(max_tokens=8, block_size=4, decoding="cdlm", ignore_eos=True)
    prompts = [_prompt(3 + 2 * s, s) for s in range(4)]
    alone = [[t for o in engine.generate(p, params) for t in o.token_ids] for p in prompts]
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outs = outputs_by_request(engine, seqs, abort_after={"r0": 2, "r3": 2})
    for rid in ("r0", "r3"):
        got = outs[rid]
        assert [o.finish_reason for o in got if o.finish_reason] == ["abort"], rid
        assert got[-1].finish_reason == "abort" and got[-1].token_ids == []
        # Two steps ran before its client left (3 forwards: cdlm's prefill is one), none after.
        assert got[-1].steps == 3
    for i in (1, 2):
        got = outs[f"r{i}"]
        assert got[-1].finish_reason == "length"
        assert [t for o in got for t in o.token_ids] == alone[i]
