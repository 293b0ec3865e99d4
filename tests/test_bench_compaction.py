"""bench/compaction.py's --layer-loss cache (one layer's compacted segment beside the other
layers' exact slots, padded with masked slots so every layer keeps its own length), and
bench/head_budgets.py's one-head swaps and schedule solver, and the bench's method specs."""

from __future__ import annotations

import torch

import tiny_models
from cdlm_serve.bench.compaction import Spec, method_spec, mixed_cache
from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
from cdlm_serve.models.loading import load_model


@torch.no_grad()
def _logits(model, cache, ids: list[int]) -> torch.Tensor:
    work = cache.extract_row(0)
    work.ensure_capacity(work.lengths[0] + len(ids))
    return model.logits(model(torch.tensor([ids]), cache=work, commit=False)[0]).float()


def _prefilled(folder, context: list[int]):
    """The tiny model and a cache holding `context`."""
    model, _ = load_model(folder)
    full = model.new_cache(1, len(context) + 16)
    with torch.no_grad():
        model(torch.tensor([context]), cache=full)
    return model, full


def test_a_layer_loss_cache_is_exact_where_it_keeps_layers_and_compacted_where_it_swaps(
    tiny_llama_dir,
):
    context = [(7 * i) % 200 + 3 for i in range(120)]
    keep_recent, target = 8, 20
    region = len(context) - keep_recent
    model, full = _prefilled(tiny_llama_dir, context)
    compacted = full.extract_row(0)
    tok = tiny_models.byte_tokenizer()
    compact_row(
        model,
        compacted,
        0,
        context,
        CompactionSpec.exact(
            target, method="am-highest-fast", query_source=None, keep_recent=keep_recent
        ),
        CompactionRuntime(tokenizer=tok),
    )
    probe = [5, 17, 42, 99]
    layers = set(range(full.num_layers))

    # No layer swapped: the full cache; every layer swapped: the compacted one (the masked
    # padding takes no attention).
    assert torch.allclose(
        _logits(model, mixed_cache(full, compacted, set(), region), probe),
        _logits(model, full, probe),
        atol=1e-5,
    )
    swapped_all = _logits(model, mixed_cache(full, compacted, layers, region), probe)
    assert torch.allclose(swapped_all, _logits(model, compacted, probe), atol=1e-5)

    # One layer swapped: that layer holds the compacted segment, the others the exact slots.
    one = mixed_cache(full, compacted, {1}, region)
    assert one.lengths == full.lengths
    assert torch.equal(one.keys[0][0, :, : full.lengths[0]], full.keys[0][0, :, : full.lengths[0]])
    assert torch.equal(one.keys[1][0, :, :target], compacted.keys[1][0, :, :target])
    assert torch.isinf(one.biases[1][0, :, target:region]).all()
    assert torch.equal(
        one.keys[1][0, :, region : full.lengths[0]], full.keys[1][0, :, region : full.lengths[0]]
    )
    mixed = _logits(model, one, probe)
    assert not torch.allclose(mixed, _logits(model, full, probe), atol=1e-4)
    assert not torch.allclose(mixed, swapped_all, atol=1e-4)


def test_head_budget_swaps_change_one_head_and_pad_invisibly(tiny_llama_dir):
    """bench/head_budgets.py's influence cache: the uniform segment padded to 2t decodes like
    the compacted cache itself, swapping one head's segment writes that head alone (in every
    row), and the batched facts NLL is the mean of each question's own."""
    from cdlm_serve.bench.facts import answer_nll
    from cdlm_serve.bench.head_budgets import facts_nll, put_head, segments, swapped_cache

    context = [(5 * i) % 190 + 7 for i in range(120)]
    keep_recent, target = 8, 12
    region = len(context) - keep_recent
    model, full = _prefilled(tiny_llama_dir, context)
    tok = tiny_models.byte_tokenizer()
    by_level = {}
    for t in (target, 2 * target):
        compacted = full.extract_row(0)
        compact_row(
            model,
            compacted,
            0,
            context,
            CompactionSpec.exact(
                t, method="am-highest-fast", query_source=None, keep_recent=keep_recent
            ),
            CompactionRuntime(tokenizer=tok),
        )
        by_level[t] = (compacted, segments(compacted, t))
    uniform, base = by_level[target]
    facts = [([40, 41, 42], [50, 51]), ([60, 61, 62, 63, 64, 65], [70]), ([80], [90, 91, 92, 93])]
    work = swapped_cache(full, region, base, 2 * target, rows=len(facts))
    probe = [5, 17, 42, 99]
    for row in range(len(facts)):
        mine = _logits(model, work.extract_row(row), probe)
        assert torch.allclose(mine, _logits(model, uniform, probe), atol=1e-5)

    def each(cache) -> float:  # the mean of the questions' NLLs, one question at a time
        return sum(answer_nll(model, cache, q, a) for q, a in facts) / len(facts)

    with torch.no_grad():
        assert abs(facts_nll(model, work, facts) - each(uniform)) < 1e-4
    before = [k.clone() for k in work.keys]
    put_head(work, 1, 0, by_level[2 * target][1][1], 2 * target)
    for layer, (old, new) in enumerate(zip(before, work.keys, strict=True)):
        changed = (old != new).any(dim=-1).any(dim=-1)  # [rows, Hkv]: which heads' slots moved
        for row in changed.tolist():
            assert row == [layer == 1 and h == 0 for h in range(len(row))]
    one = work.extract_row(2)
    assert not torch.allclose(_logits(model, one, probe), _logits(model, uniform, probe))
    with torch.no_grad():
        swapped = facts_nll(model, work, facts)
        assert abs(swapped - each(one)) < 1e-4 and abs(swapped - each(uniform)) > 1e-4


def test_the_schedule_solver_spends_the_total_where_the_loss_falls_fastest():
    from cdlm_serve.bench.head_budgets import solve

    # Loss changes from t at t/2, 2t, 4t, 8t. Head 0 loses much at t/2 and gains much at 2t,
    # no more after; head 1 neither; head 2 gains from 2t only a little, and head 3's loss rises
    # with more slots (noise): it gets nothing above t/2.
    changes = [
        [0.5, -0.4, -0.4, -0.4],
        [0.01, 0.0, 0.0, 0.0],
        [0.05, -0.02, -0.02, -0.02],
        [0.0, 0.1, 0.1, 0.1],
    ]
    slots = solve(changes, 10)
    assert sum(slots) == 40 and slots[0] == 20 and slots[3] == 5
    assert slots[0] > slots[2] >= slots[1] >= 5
    # Still falling at 4t: head 0 takes slots past 2t before anyone's shallower segments.
    changes[0][2:] = [-0.9, -0.9]
    assert solve(changes, 10) == [25, 5, 5, 5]
    # And past 4t (0.015 per slot from 4t to 8t, more than the others' 0.01 from t/2 to t).
    falling = [[0.5, -0.4, -0.9, -1.5]] + [[0.05, -0.02, -0.02, -0.02]] * 7
    assert solve(falling, 10) == [45] + [5] * 7
    # A curve that falls fastest from 2t to 4t is made convex: head 0's segments merge into
    # one of 0.0157 per slot, which beats head 1's t -> 2t (0.012) where head 0's first
    # segment alone (0.01) would not: the last 5 slots go to head 0, not head 1.
    steep_late = [[0.05, -0.01, -0.5, -0.5], [0.3, -0.12, -0.12, -0.12]]
    assert solve(steep_late, 10) == [10, 10]


def test_a_solved_schedule_gives_back_its_slots_at_its_ratio_and_scales_at_others():
    """The server applies a schedule (`from_schedule`) as the calibration solved it: the same
    slots at the target it was solved for, half of them (within rounding) at half of it."""
    import random

    from cdlm_serve.bench.head_budgets import shares_of, solve
    from cdlm_serve.engine.compaction.budgets import from_schedule

    rng = random.Random(1)
    for _ in range(50):
        layers, heads, target = rng.randint(1, 6), rng.randint(1, 4), 2 * rng.randint(4, 30)
        changes = [
            [rng.uniform(-0.01, 0.3), *(rng.uniform(-0.3 * k, 0.01) for k in (1, 2, 4))]
            for _ in range(layers * heads)
        ]
        slots = solve(changes, target)
        shares = shares_of(slots, heads)
        region = 10 * target
        assert [x for layer in from_schedule(shares, target, region) for x in layer] == slots
        half = [x for layer in from_schedule(shares, target // 2, region) for x in layer]
        assert sum(half) == len(slots) * (target // 2)
        assert all(abs(h - s / 2) <= 1 for h, s in zip(half, slots, strict=True))


def test_method_specs_name_source_budgets_quantization_and_key_ranking():
    """METHOD[:SOURCE][+flags]: each flag reaches its setting, in any order, and a method's
    keys are ranked as the server ranks them unless a flag says otherwise."""
    assert method_spec("am-highest") == Spec(
        "am-highest", "repeat+self-study", None, "uniform", "context"
    )
    assert method_spec("am-highest-fast+measured+ctxkeys") == Spec(
        "am-highest-fast", "repeat-banded", None, "measured", "context"
    )
    assert method_spec("am-highest:repeat+refkeys+int8") == Spec(
        "am-highest", "repeat", "int8", "uniform", "reference"
    )
    assert method_spec("am-omp:repeat+self-study+attn").budgets == "attention"
    assert method_spec("h2o").keys == "reference"
    assert method_spec("am-highest-fast").keys == "context"  # the server's default for it too
