"""Non-uniform compaction budgets: how many slots each layer's KV head gets.

A uniform compaction gives every (layer, KV head) the same t slots, but heads differ in how
much of their attention a few keys carry: a head that looks at a handful of positions loses
little at t, one that spreads its attention loses much. `allocate` hands out the same total,
L x Hkv x t, by measured attention: for every head, its keys' attention from the reference
queries (RMS over queries, as HighestAttnKeys scores them), sorted and normalized to sum to
one, is the share of the head's attention that its k best keys would keep; the total goes to
the (head, k) steps with the largest shares, all heads at once, so a slot goes where it keeps
the most attention. Every head keeps at least t / 4 and at most 2t slots: the floor because
the fit needs keys to match at all, the ceiling because a segment is as long as its longest
head in a cache row (the other heads' extra slots are padding, masked with a -inf bias, which
costs attention time and, in a running batch, memory; on disk the segment is stored ragged,
`engine/session_files.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.attention_matching import HeadInputs, highest_attention_scores
from models.kv_cache import KVCache

ALLOCATION_QUERIES = 512  # per KV head: enough to rank its keys, a quarter of a fit's cost


def allocate(
    cfg: Any,
    cache: KVCache,
    row: int,
    region: int,
    target: int,
    queries: list[Tensor],
    generator: torch.Generator,
) -> list[list[int]]:
    """Per layer, per KV head, the slots it gets (summing to layers x heads x target), from
    every layer's reference queries [H, n, D]."""
    low, high = max(1, target // 4), min(region, 2 * target)
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
                scale=cfg.head_dim**-0.5,
                bias=None if bias is None else bias[g, :region].float().cpu(),
            )
            score = highest_attention_scores(h).sort(descending=True).values
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
