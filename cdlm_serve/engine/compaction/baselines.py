"""Token-selection baselines for KV compaction, each as its paper defines it. They share
Attention Matching's interface (`engine.compaction.attention_matching.compact_head`): choose t of a
KV head's region slots, keep their keys, values and bias; no fit.

Scores that need the context's own queries (SnapKV, H2O, Expected Attention) read them per
query head of the KV head's group (`HeadInputs.head_queries`, in position order, never
subsampled), attend causally (a query sees the keys at or before its position) and take their
softmax over every key of the row: the region's and the exact recent tail's after it
(`HeadInputs.tail_keys`), as attention at prefill time did.

- StreamingLLM (Xiao et al. 2023): the first 4 tokens (attention sinks) and the most recent.
- H2O (Zhang et al. 2023): heavy hitters by attention accumulated over every query of the
  context, half the budget, plus the most recent tokens, the other half.
- SnapKV (Li et al. 2024): votes of an observation window (the context's last 32 queries),
  each query head's softmax summed over the window, 1-D max-pooled over neighbouring keys
  (kernel 7), summed over the group's heads; the window's own keys are always kept.
- KVzip-style (Kim et al. 2025; in `engine.compaction.attention_matching`, as HighestAttnKeys with
the
  max): keys by their maximum attention from repeat-the-context queries.
- Expected Attention (kvpress, Devoto et al. 2025): the attention that *future* queries are
  expected to pay, from the statistics of the context's queries: their pre-RoPE mean mu and
  covariance S per query head (the first 4 positions, outliers, left out), rotated by the
  average RoPE rotation R of the next 512 positions; a key k scores
  softmax_k(mu'.k * scale + k^T S' k * scale^2 / 2) (the log of E[exp(q.k * scale)] for a
  Gaussian q), averaged over the group's heads and multiplied by ||v||; the 4 sinks are kept.
- random: a seeded random subset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from cdlm_serve.models.rope import rotate_half

SINKS = 4  # StreamingLLM's attention sinks; Expected Attention keeps as many
SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 7
EXPECTED_FUTURE = 512  # Expected Attention's future positions
QUERY_CHUNK = 256  # context queries scored at a time (bounds the [G, chunk, T] scores)


class BaselineInputs(Protocol):
    """What the baselines read of a KV head: `engine.compaction.attention_matching.HeadInputs` (its
    fields' meanings there), as a protocol because that module imports this one."""

    keys: Tensor
    values: Tensor
    scale: float
    bias: Tensor | None
    head_queries: Tensor | None
    query_positions: Tensor | None
    key_positions: Tensor | None
    tail_keys: Tensor | None
    tail_bias: Tensor | None
    tail_positions: Tensor | None
    future: tuple[Tensor, Tensor] | None


def streaming(total: int, t: int, sinks: int = SINKS) -> Tensor:
    """StreamingLLM: the first `sinks` slots and the most recent t - sinks."""
    sinks = min(sinks, t)
    return torch.cat([torch.arange(sinks), torch.arange(total - (t - sinks), total)])


def random_keys(total: int, t: int, generator: torch.Generator) -> Tensor:
    return torch.randperm(total, generator=generator)[:t].sort().values


def _top(score: Tensor, t: int, forced: Tensor) -> Tensor:
    """The `forced` slots and the t - len(forced) best-scoring others, sorted."""
    score = score.clone()
    score[forced] = float("inf")
    return score.topk(t).indices.sort().values


def row_keys(h: BaselineInputs) -> tuple[Tensor, Tensor]:
    """Every key a query of the row attends to, fp32 [T + R, D], and its bias [T + R]: the
    region's, then the exact tail's after it (h.tail_keys, where given)."""
    keys = h.keys.float()
    bias = torch.zeros(keys.shape[0]) if h.bias is None else h.bias.float()
    if h.tail_keys is not None and h.tail_keys.shape[0]:
        assert h.tail_bias is not None  # set with tail_keys
        keys = torch.cat([keys, h.tail_keys.float()])
        bias = torch.cat([bias, h.tail_bias.float()])
    return keys, bias


def causal_probabilities(h: BaselineInputs, rows: slice | None = None) -> Iterator[Tensor]:
    """Attention of the context's own queries (h.head_queries [G, n, D], rows `rows` of them)
    as it was at prefill: each query's softmax over the row's keys at or before its position
    (the region's, then the exact tail's). Yields, per chunk of queries, their probabilities
    on the region's first k keys [G, chunk, k] (no query of the chunk sees past those), each
    valid until the next is asked for: the chunks' scores and probabilities reuse two
    buffers (fresh [G, chunk, k] temporaries per chunk cost more than the softmax), and only
    the keys past the chunk's first query can be masked. The queries go in position order,
    QUERY_CHUNK at a time, each chunk over the keys up to its last one's position only: a
    causal pass reads about half the keys, like its prefill."""
    # select_keys checked the context's queries are there; _add_context sets them, the key
    # positions and the tail together
    assert h.head_queries is not None and h.query_positions is not None
    assert h.key_positions is not None
    q_all, q_pos = h.head_queries, h.query_positions
    if rows is not None:
        q_all, q_pos = q_all[:, rows], q_pos[rows]
    order = q_pos.argsort(stable=True)
    q_all, q_pos = q_all[:, order], q_pos[order]
    region, pos = h.keys.shape[0], h.key_positions
    keys, bias = row_keys(h)
    if h.tail_keys is not None and h.tail_keys.shape[0]:
        assert h.tail_positions is not None
        pos = torch.cat([pos, h.tail_positions])
    keys_t = keys.T  # [D, K]
    heads = q_all.shape[0]
    size = heads * min(QUERY_CHUNK, q_all.shape[1]) * keys.shape[0]
    scores, probabilities = torch.empty(size), torch.empty(size)
    for start in range(0, q_all.shape[1], QUERY_CHUNK):
        q = q_all[:, start : start + QUERY_CHUNK].float()  # [G, c, D]
        at = q_pos[start : start + QUERY_CHUNK]  # [c], ascending
        seen = max(1, int((pos <= at[-1]).sum()))  # the keys' positions ascend: a prefix
        early = int((pos <= at[0]).sum())  # keys every query of the chunk sees
        shape = (heads, q.shape[1], seen)
        s = scores[: q.shape[1] * heads * seen].view(shape)
        torch.matmul(q, keys_t[:, :seen], out=s)
        s.mul_(h.scale).add_(bias[:seen])  # [G, c, seen]
        if early < seen:
            later = pos[None, early:seen] > at[:, None]  # [c, seen - early]
            s[..., early:].masked_fill_(later, float("-inf"))
        p = probabilities[: s.numel()].view(shape)
        torch.ops.aten._softmax.out(s, -1, False, out=p)
        yield p[..., :region]


def accumulated_attention(h: BaselineInputs) -> Tensor:
    """[T] H2O's heavy-hitter score: each region key's attention summed over the context's
    queries (`causal_probabilities`: every query head given, each query over the keys at or
    before it)."""
    accumulated = torch.zeros(h.keys.shape[0])
    for p in causal_probabilities(h):
        accumulated[: p.shape[-1]] += p.sum(dim=(0, 1))
    return accumulated


def h2o(h: BaselineInputs, t: int) -> Tensor:
    """H2O: half the budget to the heavy hitters (attention accumulated over every query of
    the context, summed over the group's heads), half to the most recent slots."""
    total = h.keys.shape[0]
    recent = t // 2
    return _top(accumulated_attention(h), t, torch.arange(total - recent, total))


def snapkv(
    h: BaselineInputs, t: int, window: int = SNAPKV_WINDOW, kernel: int = SNAPKV_KERNEL
) -> Tensor:
    """SnapKV: the observation window's votes (the context's last `window` queries, summed per
    query head), max-pooled over `kernel` neighbouring keys per head, summed over the group;
    the window's own keys (those inside the region) are always kept."""
    assert h.head_queries is not None  # checked by select_keys
    assert h.query_positions is not None and h.key_positions is not None  # set with them
    total = h.keys.shape[0]
    n = h.head_queries.shape[1]
    votes = torch.zeros(h.head_queries.shape[0], total)  # [G, T]
    for p in causal_probabilities(h, slice(max(0, n - window), n)):
        votes[:, : p.shape[-1]] += p.sum(dim=1)
    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel, 1, kernel // 2)[:, 0]
    last = int(h.query_positions[-1]) if n else total - 1
    in_window = (h.key_positions > last - window).nonzero().flatten()
    return _top(pooled.sum(dim=0), t, in_window[:t])


def future_query_statistics(
    queries: Tensor, cos: Tensor, sin: Tensor, future_cos: Tensor, future_sin: Tensor
) -> tuple[Tensor, Tensor]:
    """Expected Attention's statistics of the queries to come, per query head: the captured
    post-RoPE queries [H, n, D] at positions with cos/sin [n, D] are rotated back (RoPE is a
    rotation), the first SINKS left out; their mean [H, D] and covariance [H, D, D] are
    rotated by the average of the future positions' rotations (cos/sin [F, D])."""
    q = queries.float()
    pre = q * cos - rotate_half(q) * sin  # [H, n, D] before RoPE
    pre = pre[:, SINKS:] if pre.shape[1] > SINKS + 1 else pre
    mean = pre.mean(dim=1)  # [H, D]
    centred = pre - mean[:, None]
    cov = centred.transpose(1, 2) @ centred / max(1, pre.shape[1])  # [H, D, D]
    d = q.shape[-1]
    half = d // 2
    swap = torch.zeros(d, d)  # rotate_half as a matrix: rotate_half(x) = swap @ x
    swap[half:, :half] = torch.eye(half)
    swap[:half, half:] = -torch.eye(half)
    rotation = (
        torch.diag(future_cos.float().mean(0)) + torch.diag(future_sin.float().mean(0)) @ swap
    )
    return mean @ rotation.T, rotation @ cov @ rotation.T


def expected_attention(h: BaselineInputs, t: int, sinks: int = SINKS) -> Tensor:
    """Expected Attention: keys by the attention the future queries (h.future: per query head
    of the group, mean [G, D] and covariance [G, D, D]) are expected to pay them, softmax over
    every key of the row, averaged over the group's heads, times the value's norm; the first
    `sinks` slots are kept."""
    assert h.future is not None  # checked by select_keys
    mean, cov = h.future
    total = h.keys.shape[0]
    keys, bias = row_keys(h)
    quadratic = torch.einsum("kd,gde,ke->gk", keys, cov, keys)  # [G, T + R]
    s = mean @ keys.T * h.scale + quadratic * h.scale**2 / 2 + bias
    expected = torch.softmax(s, dim=-1)[:, :total].mean(dim=0)  # [T]
    score = expected * h.values.float().norm(dim=-1)
    return _top(score, t, torch.arange(min(sinks, t)))
