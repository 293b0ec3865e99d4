"""Compacting a model's cache row end to end (engine/compaction/row.py): queries, fits, splice,
budgets, storage of the segment. One concern, on one tiny model fixture; the single-head
algebra is tests/test_attention_matching.py."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from cdlm_serve.engine.compaction.attention_matching import HeadInputs
from cdlm_serve.engine.compaction.head import select_keys
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cpu_features import ISAS, kernel_build


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import tiny_models
    from cdlm_serve.models.loading import load_model

    folder = tmp_path_factory.mktemp("llama")
    tiny_models.hf_tiny(
        "llama",
        folder,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
    )
    model, _ = load_model(folder)
    return model, tiny_models.byte_tokenizer()


def _prefilled(model, ids):
    cache = model.new_cache(1, 256)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    return cache


def _next_logits(model, cache, token):
    """The next token's logits [V] as the engines compute them (`ModelRunner.extend`: the fused
    CPU step where it applies, so `fused` tests below reach it)."""
    with torch.no_grad():
        return model.logits(ModelRunner(model).extend([(0, [token])], cache))[0]


@pytest.mark.parametrize(
    "source", ["context", "repeat", "repeat-banded", "self-study", "on-policy"]
)
def test_full_size_compaction_of_a_model_cache_changes_nothing(tiny, source):
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    model, tok = tiny
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _next_logits(model, _prefilled(model, ids), 7)
    cache = _prefilled(model, ids)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(50, method="am-highest", query_source=source, keep_recent=10),
        CompactionRuntime(tokenizer=tok),
    )
    assert (report.tokens_before, report.tokens_after, report.logical_length) == (60, 60, 60)
    assert report.reference_queries > 0 and report.output_error <= 1e-3
    assert set(report.seconds) >= {"queries", "keys", "beta", "values", "total"}
    assert (_next_logits(model, cache, 7) - ref).abs().max().item() <= 1e-3


def test_compacted_cache_continues_from_the_logical_length(tiny):
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    model, tok = tiny
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _next_logits(model, _prefilled(model, ids), 7)
    errors = {}
    for method in ("am-highest", "streaming"):
        cache = _prefilled(model, ids)
        report = compact_row(
            model,
            cache,
            0,
            ids,
            CompactionSpec.exact(20, method=method, query_source="repeat", keep_recent=8),
            CompactionRuntime(tokenizer=tok),
        )
        assert cache.lengths == [28] and cache.logical == [120] and report.ratio == 120 / 28
        assert cache.next_positions(1, torch.device("cpu")).item() == 120
        errors[method] = (_next_logits(model, cache, 7) - ref).norm().item()
    assert errors["am-highest"] < errors["streaming"]
    # Compaction composes: a compacted row compacts again.
    cache = _prefilled(model, ids)
    compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(40, query_source="repeat", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    again = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(20, query_source="repeat", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    assert cache.lengths == [28] and cache.logical == [120] and again.tokens_before == 48


def test_banded_repeat_queries_are_the_repeat_pass_with_each_token_near_its_original(
    tiny, monkeypatch
):
    """repeat-banded: the repeat pass under `Band` (every repeated token after the
    instruction lined up with its own cached slot). A window wider than the context gives the
    repeat queries exactly; a narrow one changes them. On a row compacted before, the repeated
    tokens after its segment line up with their slots and all see the segment: again exact
    with a wide window, changed by a narrow one; where the segment is not known, the full
    pass. The -fast variants default to it on a CPU."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction import queries as compaction_queries
    from cdlm_serve.engine.compaction.options import REPEAT_INSTRUCTION, default_query_source
    from cdlm_serve.engine.compaction.queries import reference_queries

    model, tok = tiny
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = _prefilled(model, ids)

    def queries(source: str, segment: int | None = None) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(reference_queries(model, tok, cache, 0, ids, source, segment=segment))

    exact = queries("repeat")
    instruction = len(tok.encode(REPEAT_INSTRUCTION, add_special_tokens=False))
    band = compaction_queries.repeat_band(cache, 0, instruction)
    assert band is not None and (band.offset, band.lead) == (-instruction, instruction)
    monkeypatch.setattr(compaction_queries, "REPEAT_WINDOW", 200)
    for a, b in zip(exact, queries("repeat-banded"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(compaction_queries, "REPEAT_WINDOW", 4)
    monkeypatch.setattr(compaction_queries, "REPEAT_ROWS", 8)
    narrow = queries("repeat-banded")
    torch.testing.assert_close(narrow[0], exact[0])  # layer 0's queries come before attention
    assert (narrow[1] - exact[1]).abs().max() > 1e-3
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(20, query_source="repeat", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    assert (cache.lengths, cache.logical, report.segment_slots) == ([28], [90], 20)
    assert compaction_queries.repeat_band(cache, 0, instruction) is None  # segment not known
    exact = queries("repeat")
    for a, b in zip(exact, queries("repeat-banded"), strict=True):
        torch.testing.assert_close(a, b)
    band = compaction_queries.repeat_band(cache, 0, instruction, segment=20)
    assert band is not None and (band.offset, band.sinks) == (-instruction - 62, 20)
    narrow = queries("repeat-banded", segment=20)
    assert (narrow[1] - exact[1]).abs().max() > 1e-3
    monkeypatch.setattr(compaction_queries, "REPEAT_WINDOW", 200)
    monkeypatch.setattr(compaction_queries, "REPEAT_ROWS", 256)
    for a, b in zip(exact, queries("repeat-banded", segment=20), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for method in ("am-highest-fast", "am-omp-fast"):
        assert default_query_source(method, cpu) == "repeat-banded"
        assert default_query_source(method, gpu) == "repeat"  # there the band is only a mask
    assert default_query_source("am-omp", cpu) == "repeat"


def test_a_long_history_is_repeated_in_pieces_each_lined_up_with_its_own_slots(tiny, monkeypatch):
    """Past REPEAT_BUDGET context tokens the repeat pass reads pieces of REPEAT_PIECE spread
    evenly over the history, its last tokens always: as many queries for a history twice as
    long (the instruction's once). A piece's repeated tokens line up with their own cached
    slots: the last piece is blind to slots far before it and sees those near it."""
    from cdlm_serve.engine.compaction import options as compaction_options
    from cdlm_serve.engine.compaction import queries as compaction_queries
    from cdlm_serve.engine.compaction.options import REPEAT_INSTRUCTION
    from cdlm_serve.engine.compaction.queries import reference_queries, repeat_pieces

    monkeypatch.setattr(compaction_queries, "REPEAT_WINDOW", 4)
    monkeypatch.setattr(compaction_queries, "REPEAT_ROWS", 8)
    monkeypatch.setattr(compaction_options, "REPEAT_PIECE", 16)
    monkeypatch.setattr(compaction_options, "REPEAT_BUDGET", 48)
    assert repeat_pieces(48) == [(0, 48)]
    assert repeat_pieces(90) == [(0, 16), (32, 48), (74, 90)]
    assert repeat_pieces(1000) == [(0, 16), (488, 504), (984, 1000)]
    model, tok = tiny
    lead = len(tok.encode(REPEAT_INSTRUCTION, add_special_tokens=False))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (180,), generator=gen).tolist()

    def queries(ids: list[int], cache) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(reference_queries(model, tok, cache, 0, ids, "repeat-banded"))

    clean = _prefilled(model, ids[:90])
    base = queries(ids[:90], clean)
    assert all(q.shape[1] == lead + 48 for q in base)
    assert all(q.shape[1] == lead + 48 for q in queries(ids, _prefilled(model, ids)))
    last = slice(lead + 32, lead + 48)  # the piece of tokens 74..89

    def corrupted(lo: int, hi: int) -> list[torch.Tensor]:
        cache = _prefilled(model, ids[:90])
        for layer in range(len(cache.keys)):
            cache.keys[layer][0, :, lo:hi] += 3.0
            cache.values[layer][0, :, lo:hi] += 3.0
        return queries(ids[:90], cache)

    far = corrupted(4, 60)  # past the sinks, far before the last piece's slots
    for a, b in zip(base, far, strict=True):
        torch.testing.assert_close(a[:, last], b[:, last])
    assert (base[1][:, lead : lead + 16] - far[1][:, lead : lead + 16]).abs().max() > 1e-3
    near = corrupted(70, 90)
    assert (base[1][:, last] - near[1][:, last]).abs().max() > 1e-3


def test_on_policy_fits_each_layer_on_the_compacted_layers_below(tiny):
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    model, tok = tiny
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    segments = {}
    for source in ("repeat", "on-policy"):
        cache = _prefilled(model, ids)
        report = compact_row(
            model,
            cache,
            0,
            ids,
            CompactionSpec.exact(16, query_source=source, keep_recent=8),
            CompactionRuntime(tokenizer=tok),
        )
        assert cache.lengths == [24] and cache.logical == [90]
        assert report.reference_queries > len(ids)  # the instruction + the context
        segments[source] = [cache.read(0, layer) for layer in range(model.config.num_layers)]
    # Layer 0 sees the same queries either way (nothing below it); layer 1 on-policy sees the
    # outputs of a compacted layer 0, so its fit differs.
    for a, b in zip(segments["repeat"][0], segments["on-policy"][0], strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(segments["repeat"][1][2], segments["on-policy"][1][2], atol=1e-4)


def test_compaction_runs_model_work_only_in_pieces_given_to_the_engine(tiny):
    """Every forward of a compaction goes through on_engine (the server runs those pieces on
    the engine thread between decode steps), each piece runs at most one layer's attention,
    and the fits run outside them."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    model, tok = tiny
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    inside = {"now": False, "attends": 0, "most": 0}

    def on_engine(fn):
        inside["now"], inside["attends"] = True, 0
        try:
            return fn()
        finally:
            inside["now"] = False
            inside["most"] = max(inside["most"], inside["attends"])

    def guard(module, args):
        assert inside["now"] or not inside.get("armed"), "the model ran outside engine work"

    def count(module, args):
        inside["attends"] += 1

    hooks = [block.attn.qkv_proj.register_forward_pre_hook(guard) for block in model.layers]
    hooks += [block.attn.o_proj.register_forward_pre_hook(count) for block in model.layers]
    try:
        for source in ("repeat", "context", "repeat+self-study", "on-policy"):
            cache = _prefilled(model, ids)
            inside["armed"], inside["most"] = True, 0
            report = compact_row(
                model,
                cache,
                0,
                ids,
                CompactionSpec.exact(20, method="am-highest", query_source=source, keep_recent=8),
                CompactionRuntime(tokenizer=tok, on_engine=on_engine),
            )
            inside["armed"] = False
            assert cache.lengths == [28] and report.engine_jobs > model.config.num_layers
            if "self-study" not in source:  # a self-study token is one whole small forward
                assert inside["most"] == 1, source
    finally:
        for hook in hooks:
            hook.remove()


def test_omp_budget_switches_to_the_fast_variant_then_to_attention():
    from cdlm_serve.engine.compaction.attention_matching import OmpBudget, omp

    gen = torch.Generator().manual_seed(0)
    h = HeadInputs(
        torch.randn(64, 8, generator=gen),
        torch.randn(64, 8, generator=gen),
        torch.randn(32, 8, generator=gen),
        8**-0.5,
    )
    assert len(omp(h, 16, budget=OmpBudget.starting_now(60))) == 16
    spent = OmpBudget(fast_after=0.0, stop_after=float("inf"), layer=3)
    assert len(omp(h, 16, budget=spent)) == 16 and spent.fast_from == 3
    assert spent.describe() == "OMP time budget used up: am-omp-fast from layer 3"
    gone = OmpBudget(fast_after=0.0, stop_after=0.0, layer=5)
    index = omp(h, 16, budget=gone)
    assert len(set(index.tolist())) == 16 and gone.stop_from == 5
    # Out of time from the start: the keys are the ones am-highest would keep.
    assert torch.equal(index, select_keys(h, 16, "am-highest"))


@pytest.mark.parametrize("method", ["snapkv", "h2o", "expected_attention", "streaming"])
def test_baselines_compact_a_model_row_with_their_own_queries(tiny, method):
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    model, tok = tiny
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = model.new_cache(1, 256)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(20, method=method, keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    assert report.query_source == "context"
    assert cache.lengths == [28] and cache.logical == [100]
    assert report.reference_queries == len(ids)
    assert math.isfinite(report.output_error)
    if method != "streaming":
        with pytest.raises(ValueError, match="query_source must be 'context'"):
            compact_row(
                model,
                cache,
                0,
                ids,
                CompactionSpec.exact(10, method=method, query_source="repeat", keep_recent=8),
                CompactionRuntime(tokenizer=tok),
            )


@pytest.mark.parametrize("method", ["streaming", "random"])
def test_unscored_baselines_measure_their_error_on_a_reread_sample(tiny, method):
    """streaming and random score no keys: their context queries only measure the output
    error, so they re-read max_queries / group of the context's tokens
    (`context_key_queries`), after the segment on a row compacted before, instead of a pass
    over the whole history; the error is the one those very queries measure."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction.queries import context_key_queries

    model, tok = tiny
    cfg = model.config
    count = 24 // (cfg.num_heads // cfg.num_kv_heads)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(8)).tolist()
    cache = _prefilled(model, ids)
    with torch.no_grad():
        sample = [q for q, _ in context_key_queries(model, cache, 0, ids, count, seed=0)]
    twin = cache.extract_row(0)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(20, method=method, keep_recent=8),
        CompactionRuntime(tokenizer=tok, max_queries=24),
    )
    assert report.query_source == "context" and report.reference_queries == count < 100
    given = compact_row(
        model,
        twin,
        0,
        ids,
        CompactionSpec.exact(20, method=method, keep_recent=8),
        CompactionRuntime(tokenizer=tok, max_queries=24, reference=sample),
    )
    assert report.output_error == given.output_error
    again = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(10, method=method, keep_recent=4),
        CompactionRuntime(tokenizer=tok, max_queries=24, segment_slots=20),
    )
    assert again.reference_queries == min(count, 8)  # the 8 tokens after the segment
    unknown = compact_row(
        model,
        twin,
        0,
        ids,
        CompactionSpec.exact(10, method=method, keep_recent=4),
        CompactionRuntime(tokenizer=tok, max_queries=24),
    )
    assert unknown.reference_queries == 100  # segment not known: the whole pass


def test_context_key_queries_are_the_context_pass_at_a_sample_of_its_positions(tiny):
    """context_key_queries re-reads `count` seeded random tokens of a row never compacted:
    per layer, exactly the queries a causal pass over the whole context has there, the cache
    untouched; on a row compacted before whose segment is not known, the whole pass."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction.queries import context_key_queries, reference_queries

    model, tok = tiny
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    full = _prefilled(model, ids)
    whole = list(reference_queries(model, tok, full, 0, ids, "context"))  # [H, T, D] each
    sampled = list(context_key_queries(model, full, 0, ids, 12, seed=3))
    at = sampled[0][1]
    assert len(sampled) == model.config.num_layers and at.shape == (12,)
    assert bool((at.diff() > 0).all()) and int(at[-1]) < 100  # distinct, in order
    for layer, (q, positions) in enumerate(sampled):
        assert torch.equal(positions, at)
        torch.testing.assert_close(q, whole[layer][:, at], atol=1e-5, rtol=1e-5)
    assert full.lengths == [100] and full.logical == [100]
    other = next(iter(context_key_queries(model, full, 0, ids, 12, seed=4)))[1]
    assert not torch.equal(other, at)
    # A segment named for a row whose slots are its tokens is not one (nothing changes).
    named = list(context_key_queries(model, full, 0, ids, 12, seed=3, segment=30))
    assert torch.equal(named[0][1], at) and torch.equal(named[-1][0], sampled[-1][0])
    compacted = full.extract_row(0)
    compact_row(
        model,
        compacted,
        0,
        ids,
        CompactionSpec.exact(30, method="streaming", keep_recent=10),
        CompactionRuntime(tokenizer=tok),
    )
    again = list(context_key_queries(model, compacted, 0, ids, 12, seed=3))
    assert torch.equal(again[0][1], torch.arange(100))  # segment not known: the whole pass
    torch.testing.assert_close(again[-1][0], whole[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("count", [6, 50])
def test_context_key_queries_on_a_compacted_row_reread_the_tokens_after_its_segment(tiny, count):
    """On a row compacted before, with its segment's slots known, context_key_queries
    re-reads a sample of the tokens after the segment (all of them where they are fewer than
    `count`): per layer, at their logical positions, exactly the queries those tokens get
    when run as a continuation of the segment alone (its beta included), the cache
    untouched."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction.queries import context_key_queries
    from cdlm_serve.models.transformer import new_capture

    model, tok = tiny
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    cache = _prefilled(model, ids)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(30, method="am-highest", query_source="repeat", keep_recent=10),
        CompactionRuntime(tokenizer=tok),
    )
    assert report.segment_slots == 30 and cache.lengths == [40] and cache.logical == [100]
    assert any(bool(b[0, :, :30].abs().sum() > 0) for b in cache.biases)  # beta is in play
    sampled = list(context_key_queries(model, cache, 0, ids, count, seed=3, segment=30))
    at = sampled[0][1]
    assert at.shape == (min(count, 10),) and bool((at.diff() > 0).all())
    assert int(at[0]) >= 90 and int(at[-1]) < 100  # only the tokens after the segment
    segment = cache.extract_row(0)
    segment.reset(0, 30)  # the segment alone, logically 90 tokens long
    captured = new_capture(model)
    with torch.no_grad():
        model(torch.tensor([ids[90:]]), cache=segment, capture=captured)
    for layer, (q, positions) in enumerate(sampled):
        assert torch.equal(positions, at)
        expected = captured[layer][0][0][:, at - 90].float()  # [H, n, D]
        torch.testing.assert_close(q, expected, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [40] and cache.logical == [100]


def _assert_top(score: torch.Tensor, chosen: torch.Tensor, t: int) -> None:
    """`chosen` are t best of `score` up to ties: the worst one chosen scores as much as the
    t-th best (within rounding: the test sums the scores in another order than the code), so
    the t-th best swapped for the (t+1)-th fails unless those two tie."""
    assert chosen.numel() == t and chosen.unique().numel() == t
    assert float(score[chosen].min()) >= float(score.topk(t).values[-1]) - 1e-6


@pytest.mark.parametrize("max_queries", [2048, 24])
def test_am_highest_keeps_the_keys_the_context_queries_attended_to_most(tiny, max_queries):
    """compact_row's am-highest (key_queries="context", its default) on a model row: each KV
    head keeps the top-t region keys by the causal attention of its group's context queries
    (`context_key_queries`: all of them where they are fewer than max_queries, else
    max_queries / group positions re-read), over the region and the exact tail; "reference"
    ranks by the repeat queries instead, other keys."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction.queries import context_key_queries

    model, tok = tiny
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    full = _prefilled(model, ids)
    count = max_queries // group
    context = list(context_key_queries(model, full, 0, ids, count, seed=1))  # the seed's + 1
    assert context[0][0].shape[1] == min(count, 100)
    region, t = 92, 20
    cache = full.extract_row(0)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(t, method="am-highest", query_source="repeat", keep_recent=8),
        CompactionRuntime(tokenizer=tok, max_queries=max_queries),
    )
    assert report.key_queries == "context" and cache.lengths == [t + 8]
    by_reference = full.extract_row(0)
    compact_row(
        model,
        by_reference,
        0,
        ids,
        CompactionSpec.exact(
            t, method="am-highest", query_source="repeat", keep_recent=8, key_queries="reference"
        ),
        CompactionRuntime(tokenizer=tok),
    )
    differ = False
    for layer in range(cfg.num_layers):
        keys, _, _ = full.read(0, layer)  # [Hkv, T, D]
        kept, _, _ = cache.read(0, layer)
        other, _, _ = by_reference.read(0, layer)
        queries, at = context[layer]  # [H, n, D], [n]
        for g in range(cfg.num_kv_heads):
            q = queries[g * group : (g + 1) * group]  # [G, n, D]
            s = q @ keys[g].float().T * cfg.head_dim**-0.5  # [G, n, T]
            s = s.masked_fill(torch.arange(100)[None, :] > at[:, None], -math.inf)
            score = torch.softmax(s, dim=-1).sum(dim=(0, 1))[:region]  # [region]
            # The kept keys are original ones: which, and are they the t best (up to ties)?
            match = (kept[g, :t, None, :] == keys[g, None, :region, :]).all(-1)  # [t, region]
            assert bool((match.sum(-1) == 1).all())
            chosen = match.float().argmax(-1)
            _assert_top(score, chosen, t)
            differ |= not torch.equal(kept[g, :t], other[g, :t])
    assert differ  # the two rankings keep other keys
    fast = compact_row(
        model,
        full.extract_row(0),
        0,
        ids,
        CompactionSpec.exact(t, method="am-highest-fast", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    assert fast.key_queries == "context"  # its default as well
    with pytest.raises(ValueError, match="key_queries"):
        compact_row(
            model,
            full.extract_row(0),
            0,
            ids,
            CompactionSpec.exact(
                t, method="am-omp", query_source="repeat", keep_recent=8, key_queries="context"
            ),
            CompactionRuntime(tokenizer=tok),
        )
    with pytest.raises(ValueError, match="unknown key_queries"):
        compact_row(
            model,
            full.extract_row(0),
            0,
            ids,
            CompactionSpec.exact(t, method="am-highest", key_queries="magic"),
            CompactionRuntime(tokenizer=tok),
        )


def test_am_h2o_keeps_original_keys_and_values_ranked_by_the_context(tiny):
    """am-h2o on a model's cache: each kept slot is an original key with its own value (no
    values fitted), the keys ranked by the context's queries (its only ranking: 'reference' is
    refused), the beta fitted on the repeat queries (banded on a CPU): nonzero."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    model, tok = tiny
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    full = _prefilled(model, ids)
    cache, t = full.extract_row(0), 20
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(t, method="am-h2o", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    assert report.key_queries == "context" and report.query_source == "repeat-banded"
    assert cache.lengths == [t + 8] and cache.logical == [100]
    for layer in range(model.config.num_layers):
        keys, values, _ = full.read(0, layer)  # [Hkv, T, D]
        kept_k, kept_v, bias = cache.read(0, layer)
        for g in range(model.config.num_kv_heads):
            match = (kept_k[g, :t, None, :] == keys[g, None, :92, :]).all(-1)  # [t, region]
            assert bool((match.sum(-1) == 1).all())
            assert torch.equal(kept_v[g, :t], values[g, match.float().argmax(-1)])
        assert bias is not None and bool(bias[:, :t].abs().gt(0).any())
    with pytest.raises(ValueError, match="context's queries only"):
        compact_row(
            model,
            full.extract_row(0),
            0,
            ids,
            CompactionSpec.exact(t, method="am-h2o", key_queries="reference"),
            CompactionRuntime(tokenizer=tok),
        )


def _repeat_read(model, tok, seed: int):
    """100 random tokens prefilled, and the repeat-banded queries of that row, per layer
    [H, N, D]: (ids, cache, queries)."""
    from cdlm_serve.engine.compaction.queries import reference_queries

    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(seed)).tolist()
    full = _prefilled(model, ids)
    repeat = list(reference_queries(model, tok, full.extract_row(0), 0, ids, "repeat-banded"))
    return ids, full, repeat


def _kvzip_score(cfg, queries, keys, g: int) -> torch.Tensor:
    """KV head g's keys' largest attention from any of its group's queries [H, N, D] (keys
    [Hkv, T, D]): [T], each query's softmax over the whole row."""
    group = cfg.num_heads // cfg.num_kv_heads
    q = queries[g * group : (g + 1) * group].reshape(-1, cfg.head_dim)  # [N, D]
    p = torch.softmax(q @ keys[g].float().T * cfg.head_dim**-0.5, dim=-1)  # [N, T]
    return p.max(dim=0).values


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "cpu-kernel"])
@pytest.mark.parametrize("max_queries", [2048, 24])
def test_kvzip_keeps_the_keys_some_repeat_query_attends_to_most(tiny, max_queries, fused):
    """kvzip on a model row: each KV head keeps the t region keys with the largest attention
    from any one of its group's repeat queries (banded on a CPU), each query's softmax over
    the whole row (region and exact tail), with their own values and no bias; every query
    counts, not the fits' sample of max_queries. Scored by torch, and by the CPU kernel the
    server runs (`kernels.repeat_max`)."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.models import kernels

    model, tok = tiny
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    ids, full, repeat = _repeat_read(model, tok, seed=8)
    region, t = 92, 20
    assert repeat[0].shape[1] * group > 4 * max_queries or max_queries > 1024
    cache = full.extract_row(0)
    with kernels.cpu_kernels(fused):
        calls = kernels._kernel.calls() if fused else 0
        report = compact_row(
            model,
            cache,
            0,
            ids,
            CompactionSpec.exact(t, method="kvzip", keep_recent=8),
            CompactionRuntime(tokenizer=tok, max_queries=max_queries),
        )
        assert not fused or kernels._kernel.calls() > calls, "the CPU kernel did not run"
    assert report.query_source == "repeat-banded" and cache.lengths == [t + 8]
    for layer in range(cfg.num_layers):
        keys, values, _ = full.read(0, layer)  # [Hkv, T, D]
        kept_k, kept_v, bias = cache.read(0, layer)
        for g in range(cfg.num_kv_heads):
            score = _kvzip_score(cfg, repeat[layer], keys, g)[:region]
            match = (kept_k[g, :t, None, :] == keys[g, None, :region, :]).all(-1)  # [t, region]
            assert bool((match.sum(-1) == 1).all())
            chosen = match.float().argmax(-1)
            assert torch.equal(kept_v[g, :t], values[g, chosen])
            _assert_top(score, chosen, t)
        assert bias is None or bool(bias[:, :t].eq(0).all())


def test_global_budgets_give_kvzips_slots_to_its_best_scores_over_every_head(tiny):
    """budgets="global": kvzip's slots (layers x KV heads x t) go to its highest key scores
    over every head and layer at once, as KVzip's paper and kvpress evict, each head at least
    one: every head keeps its own top keys, as many as the global ranking gives it (the scores
    compared as they are, not per head normalized), the total kept."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction.budgets import global_counts

    model, tok = tiny
    cfg = model.config
    ids, full, repeat = _repeat_read(model, tok, seed=9)
    region, t = 92, 12
    scores = [  # per (layer, head): its keys' largest attention from a repeat query [region]
        _kvzip_score(cfg, repeat[layer], full.read(0, layer)[0], g)[:region]
        for layer in range(cfg.num_layers)
        for g in range(cfg.num_kv_heads)
    ]
    counts = [1] * len(scores)
    ranked = [s.sort(descending=True).values for s in scores]
    for _ in range((t - 1) * len(scores)):  # one slot at a time, to the best score left
        room = [i for i in range(len(scores)) if counts[i] < region]
        best = max(room, key=lambda i: ranked[i][counts[i]])
        counts[best] += 1
    assert len(set(counts)) > 2  # the heads differ: a uniform split would fail below
    cache = full.extract_row(0)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(t, method="kvzip", keep_recent=8, budgets="global"),
        CompactionRuntime(tokenizer=tok),
    )
    assert report.budgets == "global" and report.head_slots == t * len(scores)
    assert cache.lengths == [max(counts) + 8] and report.segment_slots == max(counts)
    for layer in range(cfg.num_layers):
        keys, values, _ = full.read(0, layer)
        kept_k, kept_v, bias = cache.read(0, layer)
        assert bias is not None
        for g in range(cfg.num_kv_heads):
            i = layer * cfg.num_kv_heads + g
            segment = max(counts)
            seen = ~torch.isneginf(bias[g, :segment])  # [segment]: the head's real slots
            assert int(seen.sum()) == counts[i], (layer, g)
            kept = kept_k[g, :segment][seen]  # [count, D]
            match = (kept[:, None, :] == keys[g, None, :region, :]).all(-1)  # [count, region]
            assert bool((match.sum(-1) == 1).all())
            chosen = match.float().argmax(-1)
            assert torch.equal(kept_v[g, :segment][seen], values[g, chosen])
            _assert_top(scores[i], chosen, counts[i])
    with pytest.raises(ValueError, match="key scores"):
        CompactionSpec.exact(t, method="am-highest", budgets="global")
    # An auto-compaction's cap on a head (`AutoCompact.longest`) holds, the total kept.
    capped = global_counts(ranked, t, region, cfg.num_kv_heads, longest=t + 2)
    assert max(map(max, capped)) == t + 2 and sum(map(sum, capped)) == t * len(scores)


def test_growing_nnls_refits_equal_scipys_nnls_on_every_prefix():
    """OMP's refits (a Cholesky factor grown with the columns, the active-set NNLS where the
    least-squares weights are not all positive) give SciPy's NNLS optimum on each prefix of
    the chosen columns; where the optimum is interior, straight from the grown factor."""
    import numpy as np
    from scipy.optimize import nnls

    from cdlm_serve.engine.compaction.nnls import GrowingNNLS

    gen = torch.Generator().manual_seed(0)
    e = torch.exp(torch.randn(80, 40, generator=gen))  # exp-score-like columns
    weights = 1 + torch.rand(30, generator=gen)
    for m in (e[:, :30] @ weights, e[:, :5].sum(1) - 0.5 * e[:, 5:10].sum(1)):
        fit = GrowingNNLS(e, m, 30)
        for start in range(0, 30, 3):
            fit.add(list(range(start, start + 3)))
            residual = fit.residual()
            a = e[:, : start + 3].double().numpy()
            w, _ = nnls(a, m.double().numpy())
            want = m.double().numpy() - a @ w
            assert np.allclose(residual.numpy(), want, atol=1e-4 * float(m.abs().max()))
    # The first target is a positive mix of all 30: its last refit is interior.
    fit = GrowingNNLS(e, e[:, :30] @ weights, 30)
    fit.add(list(range(30)))
    fit.residual()
    assert fit.chol is not None
    torch.testing.assert_close(fit.w, weights.double(), atol=1e-6, rtol=1e-6)


def test_budgets_go_where_attention_is_spread_and_keep_the_total():
    from cdlm_serve.engine.compaction.budgets import _by_shares

    flat = torch.full((100,), 0.01)  # attention spread over every key
    peaked = torch.cat([torch.full((5,), 0.19), torch.full((95,), 0.05 / 95)])
    counts = _by_shares([flat, peaked, flat, peaked], total=4 * 20, low=5, high=40, heads=2)
    # The spread heads get the slots beyond the floor (split between them as ties fall), the
    # peaked ones keep the floor: their 5 keys hold 95% of their attention.
    assert counts[0][1] == counts[1][1] == 5 and counts[0][0] + counts[1][0] == 70
    assert all(5 <= c <= 40 for layer in counts for c in layer)


def _with_padding(cache, extra: int):
    """The cache with `extra` masked slots (zero K/V, -inf bias) after its compacted segment:
    what a shorter head of a non-uniform segment holds."""
    t = cache.lengths[0]
    grown = cache.extract_row(0)
    grown.ensure_capacity(t + extra + 8)
    for layer in range(grown.num_layers):
        for buf in (grown.keys[layer], grown.values[layer]):
            buf[0, :, extra : t + extra] = buf[0, :, :t].clone()
            buf[0, :, :extra] = 0
        b = grown.biases[layer]
        b[0, :, extra : t + extra] = b[0, :, :t].clone()
        b[0, :, :extra] = float("-inf")
    grown.lengths = [t + extra]
    return grown


@pytest.mark.parametrize("isa", [None, *ISAS], ids=["pytorch", *ISAS])
def test_masked_padding_slots_change_nothing(tiny, isa):
    """A segment's padding (the slots a shorter head does not use) is invisible: decoding
    with it gives the logits decoding without it gives, in PyTorch and in each build of the
    fused kernels."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.models import kernels

    fused = isa is not None
    model, tok = tiny
    model = model.to(torch.bfloat16) if fused else model
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    try:
        with kernel_build(isa) if fused else nullcontext(), kernels.cpu_kernels(fused):
            cache = _prefilled(model, ids)
            compact_row(
                model,
                cache,
                0,
                ids,
                CompactionSpec.exact(12, method="am-highest", keep_recent=0),
                CompactionRuntime(tokenizer=tok),
            )
            padded = _with_padding(cache, 7)
            plain = [_next_logits(model, cache, t) for t in (7, 8, 9)]
            masked = [_next_logits(model, padded, t) for t in (7, 8, 9)]
    finally:
        model.to(torch.float32)
    for a, b in zip(plain, masked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 if not fused else 2e-2, rtol=1e-4)


def _non_uniform(model, tok, seed: int, quantize: str | None = None):
    """150 random tokens compacted to 16 slots per head on average with budgets by attention
    (so the heads differ, the shorter ones padded), the last 8 kept: (ids, cache, report)."""
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = _prefilled(model, ids)
    spec = CompactionSpec.exact(
        16, method="am-highest", keep_recent=8, quantize=quantize, budgets="attention"
    )
    report = compact_row(model, cache, 0, ids, spec, CompactionRuntime(tokenizer=tok))
    return ids, cache, report


def test_a_non_uniform_segment_is_stored_ragged_and_decodes_like_the_padded_one(tiny, tmp_path):
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.sessions import files as session_files

    model, tok = tiny
    ids, cache, report = _non_uniform(model, tok, seed=6)
    heads = model.config.num_layers * model.config.num_kv_heads
    assert report.head_slots == heads * 16 and report.segment_slots > 16
    assert cache.lengths == [report.segment_slots + 8]
    assert any(torch.isneginf(b[0, :, : report.segment_slots]).any() for b in cache.biases)
    version = session_files.Version("s", "tiny", ids, None, [], 0.0, 0, 0, 0, [])
    ragged = session_files.write_version(tmp_path / "s", version, cache, 0)
    padded_bytes = cache.nbytes(0)
    assert ragged.disk_bytes < padded_bytes  # the padding takes no room on disk
    back, _ = session_files.read_cache(
        tmp_path / "s",
        session_files.recover(tmp_path / "s"),
        torch.device("cpu"),
        torch.float32,
    )
    for layer in range(model.config.num_layers):
        for got, want in zip(back.read(0, layer), cache.read(0, layer), strict=True):
            assert torch.equal(got, want)
    assert torch.equal(_next_logits(model, back, 7), _next_logits(model, cache, 7))
    uniform = _prefilled(model, ids)
    same_total = compact_row(
        model,
        uniform,
        0,
        ids,
        CompactionSpec.exact(16, method="am-highest", keep_recent=8),
        CompactionRuntime(tokenizer=tok),
    )
    assert same_total.head_slots == report.head_slots and same_total.segment_slots == 16
    with pytest.raises(ValueError, match="on-policy"):
        compact_row(
            model,
            uniform,
            0,
            ids,
            CompactionSpec.exact(
                8, method="am-highest", query_source="on-policy", keep_recent=8, budgets="attention"
            ),
            CompactionRuntime(tokenizer=tok),
        )


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_an_idle_non_uniform_session_rests_ragged_in_memory_and_unpacks_exactly(
    tiny, tmp_path, quantize
):
    """Between requests the store keeps a non-uniform session without its padding (and as
    int8 codes where quantized): it takes the bytes of its visible slots (the ragged layout the
    disk has too), and comes back slot for slot, decoding exactly as before."""
    from cdlm_serve.engine.sessions.packed_cache import PackedCache
    from cdlm_serve.engine.sessions.store import SessionStore

    model, tok = tiny
    ids, cache, report = _non_uniform(model, tok, seed=7, quantize=quantize)
    cfg = model.config
    visible = sum(int((~torch.isneginf(b[0, :, : cache.lengths[0]])).sum()) for b in cache.biases)
    assert visible == report.head_slots + cfg.num_layers * cfg.num_kv_heads * 8
    assert visible < cfg.num_layers * cfg.num_kv_heads * cache.lengths[0]  # it has padding
    store = SessionStore(tmp_path, max_bytes=1 << 30)
    session = store.create("tiny", "s")
    with session.lock:
        session.rewrite(cache.extract_row(0), list(ids), codes=report.codes)
        store.persist(session)
    store.enforce_limit()  # idle and on disk: packed, still in memory
    assert session.cache is None and session.codes is None and session.packed is not None
    described = session.describe()
    assert described["in_memory"] and described["physical_tokens"] == cache.lengths[0]
    assert described["quantized_tokens"] == (None if quantize is None else report.codes.slots)
    dim, itemsize = cfg.head_dim, cache.keys[0].element_size()
    heads = cfg.num_layers * cfg.num_kv_heads
    mask = heads * cache.lengths[0]  # one bool per slot and head
    if quantize is None:  # K and V, 4 bytes of bias, per visible slot and head; the masks
        assert described["bytes"] == visible * (2 * dim * itemsize + 4) + mask
    else:  # the segment's visible slots as codes (K, V, a value scale, the bias), the
        # per-channel key scales, its masks; the recent slots as they are (no padding there)
        coded = report.head_slots * (2 * dim + 4 + 4) + heads * dim * 4
        coded += heads * report.codes.slots  # the segment's masks
        assert described["bytes"] == coded + heads * 8 * (2 * dim * itemsize + 4)
    assert described["bytes"] < cache.nbytes(0)  # what it took in memory, padded and dense
    with session.lock:
        back = store.load(session, torch.device("cpu"), torch.float32)
    assert session.packed is None and back.lengths == cache.lengths
    assert back.logical == cache.logical
    for layer in range(cfg.num_layers):
        for got, want in zip(back.read(0, layer), cache.read(0, layer), strict=True):
            assert torch.equal(got, want)
    if quantize is not None:
        for layer in range(cfg.num_layers):
            assert torch.equal(session.codes.keys[layer], report.codes.keys[layer])
            assert torch.equal(session.codes.values[layer], report.codes.values[layer])
    assert torch.equal(_next_logits(model, back, 7), _next_logits(model, cache, 7))
    assert PackedCache.saves_memory(back, None) and not PackedCache.saves_memory(
        _prefilled(model, ids), None
    )


def test_a_measured_schedule_splits_the_total_by_its_shares_within_the_bounds():
    import random

    from cdlm_serve.engine.compaction.budgets import SCHEDULE_MOST, bounds, from_schedule

    rng = random.Random(0)
    for _ in range(300):
        layers, heads = rng.randint(1, 5), rng.randint(1, 4)
        shares = [[rng.random() ** rng.choice([1, 6]) for _ in range(heads)] for _ in range(layers)]
        shares[0][0] = 0.0 if rng.random() < 0.3 else shares[0][0]
        target = rng.randint(1, 40)
        region = rng.randint(target, 200)
        counts = [c for layer in from_schedule(shares, target, region) for c in layer]
        low, high = bounds(target, region, SCHEDULE_MOST)
        assert sum(counts) == target * layers * heads
        assert all(low <= c <= high for c in counts)
        flat = [x for layer in shares for x in layer]
        for i in range(len(flat)):  # more share, never fewer slots (up to rounding)
            for j in range(len(flat)):
                if flat[i] > flat[j]:
                    assert counts[i] >= counts[j] - 1
    # Away from the bounds the split is the shares' proportion: 1 : 3 of the total.
    assert from_schedule([[1.0, 3.0]], 40, 1000) == [[20, 60]]
    # A head with all the share gets past 2t (to 8t at most; here the total runs out first),
    # the heads without one t/4; past the most, they share what is left evenly.
    assert from_schedule([[1.0, 0.0, 0.0, 0.0]], 10, 1000) == [[34, 2, 2, 2]]
    assert from_schedule([[1.0] + [0.0] * 10], 10, 1000) == [[80] + [3] * 10]
    assert from_schedule([[0.0, 0.0]], 10, 100) == [[10, 10]]
    with pytest.raises(ValueError, match="shares"):
        from_schedule([[1.0, -1.0]], 10, 100)


def test_a_schedule_for_another_shape_is_not_loaded(tmp_path):
    import json
    from types import SimpleNamespace

    from cdlm_serve.engine.compaction.budgets import load_schedule

    cfg = SimpleNamespace(num_layers=2, num_kv_heads=3)
    (tmp_path / "m.json").write_text(json.dumps({"shares": [[0.1] * 3, [0.2] * 3]}))
    (tmp_path / "wrong.json").write_text(json.dumps({"shares": [[0.1] * 2, [0.2] * 2]}))
    assert load_schedule("m", cfg, tmp_path) == [[0.1] * 3, [0.2] * 3]
    assert load_schedule("wrong", cfg, tmp_path) is None
    assert load_schedule("absent", cfg, tmp_path) is None


@pytest.mark.parametrize("source", ["repeat", "on-policy"])
def test_measured_budgets_give_each_head_its_scheduled_slots(tiny, source):
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
    from cdlm_serve.engine.compaction.budgets import from_schedule

    model, tok = tiny
    cfg = model.config
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    # Layer 0's first head matters most, the last layer's heads least.
    shares = [[1.0] * cfg.num_kv_heads for _ in range(cfg.num_layers)]
    shares[0][0], shares[-1] = 8.0, [0.1] * cfg.num_kv_heads
    want = from_schedule(shares, 16, 142)
    cache = _prefilled(model, ids)
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(
            16, method="am-highest", query_source=source, keep_recent=8, budgets="measured"
        ),
        CompactionRuntime(tokenizer=tok, schedule=shares),
    )
    assert report.budgets == "measured" and report.head_slots == sum(map(sum, want))
    assert report.segment_slots == max(max(h) for h in want) == want[0][0]
    for layer in range(cfg.num_layers):
        visible = (~torch.isneginf(cache.biases[layer][0, :, : report.segment_slots])).sum(1)
        assert visible.tolist() == want[layer]  # each head sees exactly its slots
    assert torch.isfinite(_next_logits(model, cache, 7)).all()
    with pytest.raises(ValueError, match="no measured budget schedule"):
        compact_row(
            model,
            _prefilled(model, ids),
            0,
            ids,
            CompactionSpec.exact(16, budgets="measured"),
            CompactionRuntime(tokenizer=tok),
        )


def test_the_default_model_ships_a_schedule_of_its_shape_under_either_name():
    from types import SimpleNamespace

    from cdlm_serve.engine.compaction.budgets import load_schedule, schedule_name

    assert schedule_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert schedule_name("/models/my-model") == "my-model"
    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3)  # its config's shape
    shares = load_schedule("HuggingFaceTB/SmolLM2-135M-Instruct", smollm2)
    assert shares == load_schedule("smollm2-135m-instruct", smollm2)
    assert shares is not None and abs(sum(map(sum, shares)) - 1) < 1e-9
    assert min(min(layer) for layer in shares) > 0  # every head keeps some slots


@pytest.mark.parametrize("source", ["repeat", "repeat-banded"])
def test_a_repeat_pass_grows_the_rows_cache_by_its_tokens_not_by_doubling(tiny, source):
    """Issue 59: the repeat pass writes its tokens to scratch slots of the session's own cache.
    Grown by doubling, a 1.5K-token session sat at 6,000 slots (4x: 264 MB in float32) for its
    whole compaction; it grows by the pass's tokens, exactly."""
    from cdlm_serve.engine.compaction.queries import REPEAT_INSTRUCTION, reference_queries

    model, tok = tiny
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = _prefilled(model, ids).extract_row(0)
    cache.ensure_capacity(150, exact=True)  # grown once before (the session's was, by a pass)
    assert cache.capacity == 150
    queries = list(reference_queries(model, tok, cache, 0, ids, source))
    lead = len(tok.encode(REPEAT_INSTRUCTION, add_special_tokens=False))
    assert queries[0].shape[1] == lead + 100 and lead < 100
    assert cache.capacity == 100 + lead + 100 and cache.lengths == [100]  # doubling: 300
