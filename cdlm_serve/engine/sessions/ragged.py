"""The ragged layout of a cache with non-uniform per-head budgets: each head's visible slots only.

A compaction with non-uniform budgets gives a layer's KV heads different numbers of slots. The
batch cache is rectangular ([B, Hkv, S, D]: a decode step is one attention call over all heads
and rows), so a segment is as long as its longest head and the others' extra slots are padding
(zero keys and values, a -inf bias). At rest that padding is dropped: the session's files
(`engine.sessions.files`) and an idle session's cache in memory (`engine.sessions.packed_cache`)
hold, per layer, every head's visible slots one after the other ([sum, ...]) and which they are (a
[Hkv, n] bool mask), so a schedule that moves slots between heads costs no bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def visible_slots(bias: Tensor | None) -> Tensor | None:
    """[Hkv, n] bool: the slots a layer's bias does not mask, or None if none is masked."""
    if bias is None:
        return None
    visible = ~torch.isneginf(bias)
    return None if bool(visible.all()) else visible


def squeeze(tensors: dict[str, Tensor], visible: Tensor) -> dict[str, Tensor]:
    """Tensors [Hkv, n, ...] -> their visible slots [sum(visible), ...], head after head."""
    return {name: t[visible] for name, t in tensors.items()}


def unsqueeze(flat: Tensor, visible: Tensor, fill: float) -> Tensor:
    """`squeeze`'s inverse: [sum(visible), ...] -> [Hkv, n, ...] with `fill` in masked slots
    (0 for keys and values, -inf for a bias, so the padding stays invisible)."""
    full = flat.new_full((*visible.shape, *flat.shape[1:]), fill)
    full[visible] = flat
    return full
