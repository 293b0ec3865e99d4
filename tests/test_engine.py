"""The AR engine on a tiny model: greedy parity, seeds, stops, budgets; text assembly."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.sampling import (
    SamplingParams,
    _top_p_filter,
    sample,
    tempered_softmax,
)
from cdlm_serve.engine.decoding.text_output import TextAssembler
from cdlm_serve.models.loading import load_model
from conftest import outputs_by_request


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = tiny_models.hf_tiny("llama", folder)
    ours, _ = load_model(folder)
    tok = tiny_models.byte_tokenizer()
    return hf, AREngine(ours, tok, max_model_len=512), tok


def _run(engine, prompt, **kw):
    steps = list(engine.generate(prompt, SamplingParams(**kw)))
    ids = [t for s in steps for t in s.token_ids]
    return ids, "".join(s.text for s in steps), steps[-1].finish_reason


def test_greedy_matches_transformers_generate(setup):
    hf, engine, _ = setup
    prompt = [72, 101, 108, 108, 111]
    ids, _, finish = _run(engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tiny_models.PAD_ID,
        )
    assert ids == ref[0, len(prompt) :].tolist()
    assert finish == "length" and len(ids) == 24


def test_seed_reproducible_and_seeds_differ(setup):
    _, engine, _ = setup
    a = _run(engine, [65, 66], max_tokens=20, temperature=1.0, seed=1, ignore_eos=True)[0]
    b = _run(engine, [65, 66], max_tokens=20, temperature=1.0, seed=1, ignore_eos=True)[0]
    c = _run(engine, [65, 66], max_tokens=20, temperature=1.0, seed=2, ignore_eos=True)[0]
    assert a == b and a != c


def test_stop_token_ends_without_text(setup):
    _, engine, tok = setup
    greedy, _, _ = _run(engine, [70, 71], max_tokens=10, temperature=0.0, ignore_eos=True)
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    ids, text, finish = _run(
        engine, [70, 71], max_tokens=10, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True
    )
    assert finish == "stop"
    assert ids == greedy[: first + 1]  # the stop token is counted...
    assert text == tok.decode(greedy[:first])  # ...but never shown


def test_stop_string_cuts_text(setup):
    _, engine, _tok = setup
    _, full, _ = _run(engine, [80], max_tokens=30, temperature=0.0, ignore_eos=True)
    stop = full[5:7]
    _, text, finish = _run(
        engine, [80], max_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True
    )
    assert finish == "stop" and text == full[: full.index(stop)]


def test_abort_stops_generation(setup):
    _, engine, _ = setup
    calls = iter(range(100))
    steps = list(
        engine.generate(
            [1, 2, 3],
            SamplingParams(max_tokens=50, temperature=0.0),
            aborted=lambda: next(calls) >= 3,
        )
    )
    assert steps[-1].finish_reason == "abort" and len(steps) == 4


def test_budget_cannot_exceed_context(setup):
    _, engine, _ = setup
    with pytest.raises(ValueError):
        list(engine.generate(list(range(200)) * 3, SamplingParams(max_tokens=5)))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    kept = _top_p_filter(probs, 0.8)
    assert torch.allclose(kept, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    assert torch.equal(_top_p_filter(probs, 0.01), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(4000, 3)
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits, SamplingParams(temperature=1.0), gen)
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03)
    cold = sample(logits, SamplingParams(temperature=0.05), torch.Generator().manual_seed(0))
    assert (cold == 1).float().mean() > 0.99


@pytest.mark.parametrize("temperature", [1e-30, 2.9e-120, 5e-324])
def test_a_vanishing_temperature_samples_the_greedy_token_not_nan(temperature):
    """A temperature the API accepts (> 0), however small, samples like greedy: logits / t
    alone would be inf and their softmax NaN, which torch.multinomial refuses (a 500)."""
    logits = torch.tensor([[1.0, 7.5, -3.0, 7.0], [0.0, -1.0, 2.0, float("-inf")]])
    params = SamplingParams(temperature=temperature)
    drawn = sample(logits, params, torch.Generator().manual_seed(0))
    assert drawn.tolist() == [1, 2]
    assert torch.equal(tempered_softmax(logits, temperature), torch.eye(4)[[1, 2]])


def _feed(tok, text: str, stops: list[str]) -> tuple[list[str], TextAssembler]:
    asm = TextAssembler(tok, stops)
    deltas = []
    for t in tok.encode(text, add_special_tokens=False):
        d = asm.push(t)
        deltas.append(d.text)
        if d.stopped:
            return deltas, asm
    deltas.append(asm.flush())
    return deltas, asm


def test_text_assembler_multibyte_characters_are_never_split():
    tok = tiny_models.byte_tokenizer()
    deltas, _ = _feed(tok, "naïve café ☕ ok", [])
    assert "".join(deltas) == "naïve café ☕ ok"
    assert all("\ufffd" not in d for d in deltas)


def test_text_assembler_holds_back_a_possible_stop_prefix():
    tok = tiny_models.byte_tokenizer()
    deltas, asm = _feed(tok, "abc<EN", ["<END>"])
    # While "<EN" may still become "<END>", it is not handed out.
    assert "".join(deltas[:-1]) == "abc" and deltas[-1] == "<EN"
    deltas, asm = _feed(tok, "abc<END>xyz", ["<END>", "zzz"])
    assert "".join(deltas) == "abc" and asm.text == "abc"


def test_text_assembler_flushes_an_incomplete_character_like_a_full_decode():
    tok = tiny_models.byte_tokenizer()
    ids = [104, 105, 0xE2, 0x98]  # "hi" + the first two bytes of a three-byte character
    asm = TextAssembler(tok, [])
    streamed = "".join(asm.push(t).text for t in ids) + asm.flush()
    assert streamed == tok.decode(ids) and streamed.endswith("\ufffd")


def test_continuous_batching_gives_each_request_its_solo_answer(setup):
    """Requests of different lengths decode together, join mid-run and leave early; every
    answer equals decoding it alone (greedy, fp32)."""
    _, engine, _ = setup
    reqs = [([65, 66, 67], 12), (list(range(70, 90)), 5), ([100], 20), ([7, 8, 9, 10], 9)]
    alone = [_run(engine, p, max_tokens=n, temperature=0.0, ignore_eos=True)[0] for p, n in reqs]
    seqs = [
        engine.new_sequence(
            f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        for i, (p, n) in enumerate(reqs)
    ]
    got: dict[str, list[int]] = {}
    engine.add(seqs[0])
    engine.add(seqs[1])
    steps = 0
    while engine.has_work():
        if steps == 3:
            engine.add(seqs[2])
            engine.add(seqs[3])
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    assert [got[f"r{i}"] for i in range(4)] == alone


def test_logprobs_are_log_softmax_of_the_logits(setup):
    hf, engine, _ = setup
    prompt = [72, 101, 108]
    steps = list(
        engine.generate(
            prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
        )
    )
    first = steps[0].logprobs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    assert first.token == int(ref.argmax())
    assert abs(first.logprob - float(ref.max())) < 1e-4
    top_ids = [t for t, _ in first.top]
    assert top_ids == ref.topk(2).indices.tolist() and top_ids[0] == first.token


def test_sessions_and_long_prompts_leave_no_lasting_cost(setup):
    """After a compacted session's request, later steps carry no per-key biases (every step
    would pay for them), and an idle engine gives back a cache grown for a long prompt."""
    from cdlm_serve.engine import model_work
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.sessions.session import Session

    _, engine, tok = setup
    model = engine.model
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = model_work.prefill(model, ids)
    compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(20, method="am-highest", query_source="repeat", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    session = Session("s", "m", ids, cache)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    plain = engine.new_sequence("p", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0))
    engine.add(plain)
    engine.add(engine.new_sequence("c", [7, 8], greedy, session=session))
    engine.step()
    assert engine.cache.biases is not None  # the compacted row needs them while it runs
    while any(s.session is not None for s in engine.running):
        engine.step()
    assert engine.running == [plain] and engine.cache.biases is None
    assert session.cache.biases is not None  # the session keeps its own
    while engine.has_work():
        engine.step()
    assert engine.cache is not None and engine.cache.capacity == 256
    list(engine.generate(list(range(300)), greedy))  # a prompt longer than the first size
    assert engine.cache is None  # idle again: the grown cache is released
    # A plain session written back while a compacted one shared the batch carries no biases.
    other = Session("o", "m", [], None)
    other.extend(model_work.prefill(model, [4, 5, 6]), [4, 5, 6], None)
    engine.add(engine.new_sequence("c2", [7], greedy, session=session))
    engine.add(engine.new_sequence("o2", [9], greedy, session=other))
    while engine.has_work():
        engine.step()
    assert other.cache.biases is None and session.cache.biases is not None


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(setup):
    """Chunked prefill: a 100-token prompt joins over ceil(100 / 16) steps, a running
    sequence gets a token at every one of them, and both answers are their solo answers."""
    _, engine, _ = setup
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    short, long = [5, 6, 7], list(range(3, 103))
    solo = {name: _run(engine, p, max_tokens=12, temperature=0, ignore_eos=True)[0]
            for name, p in (("short", short), ("long", long))}  # fmt: skip
    engine.prefill_tokens = 16
    try:
        got: dict[str, list[int]] = {"short": [], "long": []}
        engine.add(engine.new_sequence("short", short, greedy))
        for out in engine.step():
            got[out.request_id] += out.token_ids
        engine.add(engine.new_sequence("long", long, greedy))
        steps_to_first = 0
        while not got["long"]:
            outs = engine.step()
            steps_to_first += 1
            assert "short" in {o.request_id for o in outs}  # decoding never waits
            for out in outs:
                got[out.request_id] += out.token_ids
        assert steps_to_first == -(-len(long) // 16)
        while engine.has_work():
            for out in engine.step():
                got[out.request_id] += out.token_ids
    finally:
        engine.prefill_tokens = 512
    assert got == solo


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_growing_cache_keeps_its_slots_and_zeroes_the_new_ones(dtype):
    """ensure_capacity doubles every layer's keys, values and biases: the old slots as they
    were, the new ones zero, each buffer contiguous as attention expects."""
    from cdlm_serve.models.kv_cache import KVCache

    gen = torch.Generator().manual_seed(0)
    cache = KVCache.allocate(2, 2, 3, 8, 5, "cpu", dtype)
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=gen))
    cache.biases = [torch.randn(2, 3, 5, generator=gen) for _ in range(2)]
    before = [t.clone() for t in cache.keys + cache.values + cache.biases]
    cache.ensure_capacity(7)
    assert cache.capacity == 10
    for old, new in zip(before, cache.keys + cache.values + cache.biases, strict=True):
        assert new.dtype == old.dtype and new.is_contiguous() and new.shape[2] == 10
        assert torch.equal(new[:, :, :5], old)
        assert not new[:, :, 5:].any()


def test_a_row_freed_by_a_compacted_session_starts_the_next_request_at_position_zero(setup):
    """A compacted session's row holds fewer slots than its logical length; the plain request
    that takes the row next must get RoPE positions from 0, not from the old row's offset
    (which RoPE's relative scores hide from its answer, but not from a session written back
    or the prefix cache, which refused the row: a 400 on the server)."""
    from cdlm_serve.engine import model_work
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
    from cdlm_serve.engine.sessions.session import Session

    _, plain, tok = setup
    model = plain.model
    engine = AREngine(model, tok, max_model_len=512, prefix_cache=PrefixCache(1 << 20))
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(7)).tolist()
    cache = model_work.prefill(model, ids)
    compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(20, method="am-highest", query_source="repeat", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    session = Session("s", "m", ids, cache)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add(engine.new_sequence("c", [7, 8], greedy, session=session))
    while engine.has_work():
        engine.step()
    assert engine.cache is not None  # the same batch cache: its row 0 held the session
    prompt = list(range(30, 70))  # 2 full blocks for the prefix cache
    after, _, _ = _run(engine, prompt, max_tokens=6, temperature=0, ignore_eos=True)
    assert engine.cache.logical[0] == engine.cache.lengths[0] == len(prompt) + 5
    assert after == _run(plain, prompt, max_tokens=6, temperature=0, ignore_eos=True)[0]
    assert len(engine.prefix_cache) == 2


def test_rows_finishing_in_the_same_step_each_finish_once(setup):
    """Three requests with the same prompt length and max_tokens finish in the same step: each
    sends exactly its max_tokens tokens and one finish, its last output (a retire that skipped
    a moved row let it run a step more: a second "length" chunk and a 4th token)."""
    _, engine, _ = setup
    prompts = [[65, 66, 67], [70, 71, 72], [80, 81, 82]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    alone = [_run(engine, p, max_tokens=3, temperature=0.0, ignore_eos=True)[0] for p in prompts]
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outs = outputs_by_request(engine, seqs)
    for i, seq in enumerate(seqs):
        got = outs[seq.id]
        assert [o.finish_reason for o in got] == [None, None, "length"], seq.id
        assert [t for o in got for t in o.token_ids] == alone[i]


def test_aborting_rows_that_are_not_the_last_leaves_the_others_answers_whole(setup):
    """Of four running rows, the first and the last abort in the same step: each sends one
    "abort" and nothing after it, and the rows that stay (moved into the freed ones) answer
    as they would alone."""
    _, engine, _ = setup
    prompts = [[65, 66], [70, 71, 72], [80, 81, 82, 83], [90]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [_run(engine, p, max_tokens=8, temperature=0.0, ignore_eos=True)[0] for p in prompts]
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outs = outputs_by_request(engine, seqs, abort_after={"r0": 3, "r3": 3})
    for rid in ("r0", "r3"):
        got = outs[rid]
        assert [o.finish_reason for o in got] == [None, None, None, "abort"], rid
        assert got[-1].token_ids == []
    for i in (1, 2):
        got = outs[f"r{i}"]
        assert [o.finish_reason for o in got][-1] == "length"
        assert [t for o in got for t in o.token_ids] == alone[i]


def test_the_engine_makes_its_own_params_from_a_requests_options(setup):
    from cdlm_serve.engine.decoding import GenerationOptions

    _, engine, _ = setup
    options = GenerationOptions(
        stop=("x",), logprobs=2, cache_salt="s", ignore_eos=True, block_size=4, steps=2
    )
    params = engine.params(options, 9, 3)
    assert params == SamplingParams(
        max_tokens=9,
        temperature=1.0,  # OpenAI's default where the request sets none
        seed=3,
        stop=["x"],
        ignore_eos=True,
        logprobs=2,
        cache_salt="s",
    )
    assert engine.params(GenerationOptions(temperature=0.0), 9, None).greedy
    assert engine.problem(500, params) is None  # an answer past the context is cut to it
    assert engine.problem(500, params, history=12).code == "context_length_exceeded"
