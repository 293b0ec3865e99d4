"""Non-uniform compaction budgets: how many slots each layer's KV head gets.

A uniform compaction gives every (layer, KV head) the same t slots, but heads differ in how
much of their attention a few keys carry: a head that looks at a handful of positions loses
little at t, one that spreads its attention loses much. `allocate` hands out the same total,
L x Hkv x t, by measured attention: for every head, its keys' attention from the reference
queries (RMS over queries; the mean, which HighestAttnKeys ranks by, allocated the same within
0.01 of the facts kept), sorted and normalized to sum to one, is the share of the head's
attention that its k best keys would keep; the total goes to the (head, k) steps with the
largest shares, all heads at once, so a slot goes where it keeps the most attention. Every head
keeps at least t / 4 and at most 2t slots: the floor because the fit needs keys to match at
all, the ceiling because a segment is as long as its longest head in a cache row (the other
heads' extra slots are padding, masked with a -inf bias, which costs attention time and, in a
running batch, memory; at rest in memory and on disk the segment is ragged,
`engine/sessions/packed_cache.py`, `engine/sessions/files.py`).

A measured schedule (`budgets="measured"`, the AM paper's idea) goes further: each head's
share of the total is how much the model's loss depends on that head's slots, measured once
per model offline (`bench/head_budgets.py`: on calibration texts unlike the evaluation ones,
one head's budget changed at a time in an otherwise uniform compaction, and the change in the
answers' NLL recorded) and shipped as a JSON file under `engine/compaction/budget_schedules/`
(`load_schedule`); `from_schedule` turns the shares into slots for a compaction's total, in
proportion (so at the calibration's ratio, the slots the calibration solved for), a head up to
8t (SCHEDULE_MOST): the heads the schedule favours are those whose loss still falls steeply at
2t and 4t.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.engine.compaction.attention_matching import HeadInputs, highest_attention_scores
from cdlm_serve.models.kv_cache import KVCache

# A measured schedule may give a head up to 8t: the heads that carry the fact lookups still
# lose steeply at 2t and 4t (bench/head_budgets.py measures each head at t/2 to 8t). A session
# rests ragged (`engine.sessions.packed_cache`), so the longest head costs memory only in a running
# batch, where the segment is as long as it.
SCHEDULE_MOST = 8
ALLOCATION_QUERIES = 512  # per KV head: enough to rank its keys, a quarter of a fit's cost
SCHEDULES = Path(__file__).parent / "budget_schedules"  # measured schedules, one per model


def bounds(
    target: int, region: int, most: float = 2, longest: int | None = None
) -> tuple[int, int]:
    """The fewest and most slots one head may get when the average is `target`: t / 4 and
    `most` x t (2 by attention, SCHEDULE_MOST by a measured schedule), the latter at most
    `longest` where given (but never under t: the average must stay reachable)."""
    high = min(region, int(most * target))
    if longest is not None:
        high = max(target, min(high, longest))
    return max(1, target // 4), high


def allocate(
    cfg: Any,
    cache: KVCache,
    row: int,
    region: int,
    target: int,
    queries: list[Tensor],
    generator: torch.Generator,
    longest: int | None = None,
) -> list[list[int]]:
    """Per layer, per KV head, the slots it gets (summing to layers x heads x target), from
    every layer's reference queries [H, n, D]; none more than `longest` where given."""
    low, high = bounds(target, region, longest=longest)
    shares: list[Tensor] = []  # per (layer, head): the sorted shares of its ranks
    group = cfg.num_heads // cfg.num_kv_heads
    for layer, q in enumerate(queries):
        keys, _, bias = cache.read(row, layer)
        for g in range(cfg.num_kv_heads):
            pooled = q[g * group : (g + 1) * group].reshape(-1, cfg.head_dim).cpu()
            if pooled.shape[0] > ALLOCATION_QUERIES:
                pick = torch.randperm(pooled.shape[0], generator=generator)
                pooled = pooled[pick[:ALLOCATION_QUERIES]]
            h = HeadInputs(
                keys=keys[g, :region].float().cpu(),
                values=keys[g, :region].float().cpu(),  # unused here
                queries=pooled,
                scale=cfg.scale,
                bias=None if bias is None else bias[g, :region].float().cpu(),
            )
            score = highest_attention_scores(h, "rms").sort(descending=True).values
            shares.append(score / score.sum().clamp_min(1e-30))
    return _by_shares(shares, target * len(shares), low, high, cfg.num_kv_heads)


def _by_shares(
    shares: list[Tensor], total: int, low: int, high: int, heads: int
) -> list[list[int]]:
    """Every head starts at `low`; the remaining slots go to the largest shares among the
    heads' ranks low..high-1 (a head's shares fall with its rank, so what it gets is always a
    prefix of its ranking)."""
    extra = total - low * len(shares)
    candidates = torch.cat([s[low:high] for s in shares])  # [sum of (high - low)]
    owners = torch.cat(
        [torch.full((len(s[low:high]),), i, dtype=torch.long) for i, s in enumerate(shares)]
    )
    counts = torch.full((len(shares),), low, dtype=torch.long)
    if extra > 0:
        chosen = candidates.topk(min(extra, len(candidates))).indices
        counts += torch.bincount(owners[chosen], minlength=len(shares))
    flat = counts.tolist()
    return [flat[i : i + heads] for i in range(0, len(flat), heads)]


def global_counts(
    ranked: list[Tensor], target: int, region: int, heads: int, longest: int | None = None
) -> list[list[int]]:
    """Per layer, per KV head, its slots: the heads' `target` each, summed, given to their own
    key scores (each sorted descending [T]), the highest over all heads and layers at once, as
    KVzip's paper and kvpress evict. A head keeps from one slot to its whole region (at most
    `longest`, as `bounds` caps it): a floor or cap of the other budgets' kind cost kvzip what
    it is for (facts kept at 2K tokens, 4x / 10x / 20x: 0.97 / 0.81 / 0.52 without one; t / 4
    to 8t 0.97 / 0.77 / 0.19; t / 4 to 2t 0.80 / 0.28 / 0.10; uniform 0.43 / 0.16 / 0.08)."""
    _, high = bounds(target, region, most=region, longest=longest)  # most x t >= the region
    return _by_shares(ranked, target * len(ranked), 1, high, heads)


def from_schedule(
    shares: list[list[float]], target: int, region: int, longest: int | None = None
) -> list[list[int]]:
    """Per layer, per KV head, its slots: in proportion to a measured schedule's shares, each
    within `bounds` (t / 4 to SCHEDULE_MOST x t; what a bound takes or leaves goes to the
    others, in proportion), the total (layers x heads x target) exactly, the rounding
    remainders to the largest fractions. At the ratio it was measured at, a schedule that
    `bench.head_budgets` solved within those bounds gives back its slots exactly; at another
    ratio, every head's slots scale with the total. `longest`: a cap on any one head (an
    auto-compaction's room, `engine.compaction.auto.AutoCompact.longest`)."""
    flat = torch.tensor([x for layer in shares for x in layer], dtype=torch.float64)
    if len(flat) == 0 or bool((flat < 0).any()) or not bool(flat.isfinite().all()):
        raise ValueError("a budget schedule's shares must be finite and >= 0")
    low, high = bounds(target, region, SCHEDULE_MOST, longest)
    total = target * len(flat)
    exact = _proportional(flat, float(total), low, high)  # [heads], each in [low, high]
    whole = (exact + 1e-9).floor().long()
    rest = total - int(whole.sum())  # 0 <= rest < heads: exact sums to the total or just over
    fraction = (exact - whole).masked_fill(whole >= high, -1.0)
    whole[fraction.argsort(descending=True)[:rest]] += 1
    heads = len(shares[0])
    out = whole.tolist()
    return [out[i : i + heads] for i in range(0, len(out), heads)]


def _proportional(weights: Tensor, total: float, low: int, high: int) -> Tensor:
    """clip(scale x weights, low, high) summing to `total` (low x n <= total <= high x n): the
    sum grows with the scale, so bisect it. Where the heads with a weight all at `high` are
    still short of the total, the heads without one share the rest evenly."""
    most = torch.where(weights > 0, high, low).to(weights.dtype)  # [n]: as the scale grows
    if float(most.sum()) < total:
        none = weights <= 0
        rest = total - float(most[~none].sum())
        even = _proportional(none[none].to(weights.dtype), rest, low, high)
        return most.masked_scatter(none, even)

    def spent(scale: float) -> float:
        return float((weights * scale).clamp(low, high).sum())

    lo, hi = 0.0, 1.0
    while spent(hi) < total:
        hi *= 2
    for _ in range(200):  # float64: by then lo and hi are neighbours
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) < total else (lo, mid)
    return (weights * hi).clamp(low, high)


def schedule_name(spec: str) -> str:
    """The file name a model's schedule has: a built-in model's own name (whichever of its
    names `spec` is), else the last part of the path or hub id."""
    from cdlm_serve.models.sources import BUILTIN

    return BUILTIN[spec].name if spec in BUILTIN else Path(spec).name


def load_schedule(spec: str, cfg: Any, folder: Path = SCHEDULES) -> list[list[float]] | None:
    """The measured shares shipped for the model `spec` names (`schedule_name`), or None where
    there are none or they were measured on a model of another shape."""
    path = folder / f"{schedule_name(spec)}.json"
    if not path.is_file():
        return None
    shares: list[list[float]] = json.loads(path.read_text())["shares"]
    if len(shares) != cfg.num_layers or any(len(x) != cfg.num_kv_heads for x in shares):
        return None
    return shares
