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
continuations of long caches.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.attention import AttentionMask

# The CPU flash kernel, which also returns each row's log-sum-exp (a private ATen op: where a
# torch build lacks it, attention takes the masked path).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def applies(q: Tensor, mask: AttentionMask) -> bool:
    """Whether q [B, H, Q, D]'s attention is a plain causal continuation (every row's new
    tokens after the same number of cached slots) that this module computes on a CPU."""
    return (
        _FLASH is not None
        and q.device.type == "cpu"
        and mask.is_causal
        and mask.visible is None
        and mask.key_len > q.shape[2]
    )


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
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float, start: int, stop: int
) -> Tensor:
    """Attention of query rows [start, stop) of the Q new tokens (q [B, H, Q, D]) over k, v
    [B, H, K, D] whose last Q slots are the new tokens, and bias [B, H, 1, K] or None ->
    [B, H, stop - start, D]."""
    assert _FLASH is not None
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
    lse = torch.stack([p[1] for p in parts])  # [P, B, H, c]
    weights = torch.exp(lse - lse.max(dim=0).values)  # [P, B, H, c]
    out = sum(w[..., None] * p[0].float() for w, p in zip(weights, parts, strict=True))
    return (out / weights.sum(dim=0)[..., None]).to(q.dtype)


def _part(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return out, lse
