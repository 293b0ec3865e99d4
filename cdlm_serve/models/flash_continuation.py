"""Attention of new tokens that continue a KV cache, on a CPU, without a [Q, K] mask.

The new tokens see every cached slot (with its additive bias, Attention Matching's beta) and
each other causally. SDPA needs an explicit mask for that (its causal flag aligns the diagonal
to the top-left corner), and a masked SDPA on a CPU runs ~1.5x slower than its flash kernel
without one. Here the keys are cut into parts that the flash kernel handles without a boolean
mask: the cached slots (their bias as a float mask broadcast over the queries), the new tokens
before the query chunk (all visible), and the chunk's own tokens (causal, a square); the parts'
outputs are merged by their log-sum-exps, which is exact. Measured (SmolLM2's attention: 9
query heads over 3 KV heads, 4,096 new tokens after 4,096 cached, 2 cores): 0.68 s per layer
chunked with masks vs 0.47 s (bf16), 0.80 vs 0.43 s (fp32).

This is what a compaction's repeat-prefill and a session's chunked prefill run: long
continuations of long caches. With a `Band` (a compaction's banded repeat pass), each of its
blocks of new tokens attends to the few key ranges the band lets it see: O(Q x window) work.
Cached tokens read again (`models.attention.reread_mask`: a compaction's sample of the
context's own queries) each read their own prefix of the cache (`reread_rows`).

Where the fused CPU kernels are on (bf16, AVX512-BF16), each of these runs as one kernel call
per query chunk instead (`packed_rows`, `packed_reread`): the layer's keys and values packed
once (`models.kernels.pack_attention`), every row over its key ranges with an online softmax,
no parts to merge. Measured (9 query heads over 3 KV heads, 256 rows over 1,900 keys, bf16, 2
cores): 5.5-7 ms against 8-14 ms for the flash kernel on the same keys repeated per head, with
the same error against an fp32 softmax (2.3e-3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from cdlm_serve.models import kernels
from cdlm_serve.models.attention import AttentionMask, Band, disjoint

# The CPU flash kernel, which also returns each row's log-sum-exp (a private ATen op: where a
# torch build lacks it, attention takes the masked path).
_FLASH: Callable[..., tuple[Tensor, ...]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)


def applies(q: Tensor, mask: AttentionMask) -> bool:
    """Whether q [B, H, Q, D]'s attention is a plain causal continuation (every row's new
    tokens after the same number of cached slots, maybe none) that this module computes on a
    CPU. With none, a causal pass in query chunks (a compaction's context pass): each chunk
    reads only the keys up to its own, where SDPA over an explicit mask reads all of them."""
    return (
        _FLASH is not None
        and q.device.type == "cpu"
        and mask.is_causal
        and mask.visible is None
        and mask.key_len >= q.shape[2]
    )


def rereads(q: Tensor, mask: AttentionMask) -> bool:
    """Whether q [B, H, Q, D] are cached tokens read again (`models.attention.reread_mask`),
    whose attention this module computes on a CPU (`reread_rows`)."""
    return _FLASH is not None and q.device.type == "cpu" and mask.reread is not None


def per_head(
    k: Tensor, v: Tensor, bias: Tensor | None, num_heads: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """k, v [B, Hkv, K, D] and bias [B, Hkv, K] -> one per query head ([B, H, K, D] and
    [B, H, 1, K] in the queries' dtype, as the masked path rounds it): the flash kernel takes
    no GQA."""
    group = num_heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if bias is not None:
        bias = bias.to(dtype).repeat_interleave(group, dim=1)[:, :, None, :]
    return k, v, bias


def attend_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    scale: float,
    start: int,
    stop: int,
    band: Band | None = None,
) -> Tensor:
    """Attention of query rows [start, stop) of the Q new tokens (q [B, H, Q, D]) over k, v
    [B, H, K, D] whose last Q slots are the new tokens, and bias [B, H, 1, K] or None ->
    [B, H, stop - start, D]. With a `band`, only what it lets each row see."""
    assert _FLASH is not None
    if band is not None:  # its blocks: each sees a few key ranges whole
        blocks = [
            _banded_rows(q, k, v, bias, scale, block, lo, hi, band)
            for block, lo, hi in band.blocks(start, stop)
        ]
        return torch.cat(blocks, dim=2)
    q_len, key_len = q.shape[2], k.shape[2]
    cached = key_len - q_len
    rows = q[:, :, start:stop]
    parts: list[tuple[Tensor, Tensor]] = []  # (output [B, H, c, D], log-sum-exp [B, H, c])
    if cached > 0:
        mask = None if bias is None else bias[..., :cached]
        parts.append(_part(rows, k[:, :, :cached], v[:, :, :cached], scale, False, mask))
    if start > 0:
        before = slice(cached, cached + start)
        parts.append(_part(rows, k[:, :, before], v[:, :, before], scale, False, None))
    own = slice(cached + start, cached + stop)
    parts.append(_part(rows, k[:, :, own], v[:, :, own], scale, True, None))
    return _merge(parts, q.dtype)


def reread_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    scale: float,
    start: int,
    stop: int,
    slots: Tensor,
) -> Tensor:
    """Attention of rows [start, stop) of re-read cached tokens (q [B, H, Q, D]; row i is the
    token cached at slots[i], ascending, and sees the cached slots [0, slots[i]]) over k, v
    [B, H, K, D] and bias [B, H, 1, K] or None -> [B, H, stop - start, D]: the slots all of
    the rows see, [0, slots[start]], without a mask, then those up to the last row's own under
    one, merged by log-sum-exp. So each row reads about its own prefix, not all K keys."""
    rows = q[:, :, start:stop]
    own = slots[start:stop].to(q.device)  # [c]
    first, last = int(own[0]) + 1, int(own[-1]) + 1
    seen = None if bias is None else bias[..., :first]
    parts = [_part(rows, k[:, :, :first], v[:, :, :first], scale, False, seen)]
    if last > first:
        span = torch.arange(first, last, device=q.device)
        hidden = span[None, :] > own[:, None]  # [c, w]
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(hidden, float("-inf"))[None, None]  # [1, 1, c, w]
        if bias is not None:
            mask = mask + bias[..., first:last]
        out, lse = _part(rows, k[:, :, first:last], v[:, :, first:last], scale, False, mask)
        # A row that sees none of these keys (the first) gets output 0 and log-sum-exp 0 from
        # the kernel: it must weigh nothing in the merge.
        lse = lse.masked_fill(hidden.all(-1), float("-inf"))
        parts.append((out, lse))
    return _merge(parts, q.dtype)


def _banded_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    scale: float,
    block: int,
    lo: int,
    hi: int,
    band: Band,
) -> Tensor:
    """Rows [lo, hi) of the new tokens, all in the band's block `block`: the cached and
    earlier new-token ranges they see (no mask: all of them see all of those), then the rows
    themselves causally, merged by log-sum-exp -> [B, H, hi - lo, D]."""
    cached = k.shape[2] - q.shape[2]
    rows = q[:, :, lo:hi]
    parts = []
    for a, b in band.key_ranges(block, lo, cached):
        mask = None if bias is None else bias[..., a:b]
        parts.append(_part(rows, k[:, :, a:b], v[:, :, a:b], scale, False, mask))
    own = slice(cached + lo, cached + hi)
    parts.append(_part(rows, k[:, :, own], v[:, :, own], scale, True, None))
    return _merge(parts, q.dtype)


def _merge(parts: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> Tensor:
    """The parts' outputs [B, H, c, D] weighted by their log-sum-exps [B, H, c]: exact."""
    lse = torch.stack([p[1] for p in parts])  # [P, B, H, c]
    weights = torch.exp(lse - lse.max(dim=0).values)  # [P, B, H, c]
    out: Tensor = sum(w[..., None] * p[0].float() for w, p in zip(weights, parts, strict=True))
    return (out / weights.sum(dim=0)[..., None]).to(dtype)


def _part(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    assert _FLASH is not None  # applies() and rereads() checked it
    out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return out, lse


def packed_rows(
    q: Tensor,
    packed: kernels.PackedKV,
    scale: float,
    start: int,
    stop: int,
    band: Band | None = None,
) -> Tensor:
    """`attend_rows` on the packed keys and values (q [1, H, Q, D], the last Q keys are the
    new tokens): each row sees the cached slots and the new tokens up to its own (with a
    `band`, per band block, the ranges it sees and its block up to its own) -> [1, H, stop -
    start, D]."""
    cached = packed.length - q.shape[2]
    if band is None:
        return _packed(q, packed, scale, start, stop, [(0, cached + stop)], cached)
    blocks = []
    for block, lo, hi in band.blocks(start, stop):
        own = (cached + lo, cached + hi)
        ranges = disjoint([*band.key_ranges(block, lo, cached), own], 0, packed.length)
        blocks.append(_packed(q, packed, scale, lo, hi, ranges, cached))
    return torch.cat(blocks, dim=2)


def _packed(
    q: Tensor,
    packed: kernels.PackedKV,
    scale: float,
    lo: int,
    hi: int,
    ranges: list[tuple[int, int]],
    cached: int,
) -> Tensor:
    """Rows [lo, hi) over `ranges`, each new token causally: row i below key cached + i + 1."""
    limits = torch.arange(cached + lo + 1, cached + hi + 1)
    return kernels.attend_packed(q[0, :, lo:hi], packed, ranges, scale, limits)[None]


def packed_reread(
    q: Tensor, packed: kernels.PackedKV, scale: float, start: int, stop: int, slots: Tensor
) -> Tensor:
    """`reread_rows` on the packed keys and values: row i sees the cached slots up to
    slots[i], its own -> [1, H, stop - start, D]."""
    own = slots[start:stop].cpu()
    limits = own + 1
    ranges = [(0, int(limits[-1]))]
    return kernels.attend_packed(q[0, :, start:stop], packed, ranges, scale, limits)[None]
