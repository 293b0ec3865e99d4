"""An idle session's cache as it rests in memory: without its padding, its segment as codes.

A session between requests needs its cache again only when its next request comes, so the
store (`SessionStore.enforce_limit`) keeps an idle one in the form that takes the fewest bytes
and unpacks it then (`SessionStore.load`):

- the padding slots of non-uniform budgets (`engine.ragged`) are dropped: each layer holds its
  heads' visible slots only, and the mask of which they are, so a budget schedule that moves
  slots between heads costs no memory at rest (only while a request runs, in the rectangular
  batch cache);
- a compacted segment that was quantized (`engine.kv_quant`) is held as its int8 codes and
  scales, the segment's truth since its compaction, not as its dequantized values.

Unpacking gives back the dense cache and the codes that were packed, slot for slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kv_quant import QuantizedSegment, restore
from engine.ragged import squeeze, unsqueeze, visible_slots
from models.kv_cache import KVCache


@dataclass(slots=True)
class PackedCache:
    """A batch-1 cache's committed slots, per layer as named tensors: `kq`, `vq` [Hkv, q, D]
    int8 and `vs` [Hkv, q, 1] (the codes of slots [0, q)), `ks` [Hkv, 1, D] (their per-channel
    key scales), `k`, `v` [Hkv, n - q, D] (slots [q, n) in the cache's dtype), `b` [Hkv, n]
    (every slot's bias, where the cache has biases); with a mask `m` [Hkv, n] where some slots
    are padding, and then every tensor but `ks` holds the visible slots only, [sum, ...]."""

    quantized: int  # q: slots [0, q) are held as int8 codes (0: none)
    length: int  # n, the physical slots
    logical: int
    heads: int
    dim: int
    dtype: torch.dtype
    device: torch.device
    layers: list[dict[str, Tensor]]

    @staticmethod
    def saves_memory(cache: KVCache, codes: QuantizedSegment | None) -> bool:
        """Whether packing takes fewer bytes than the dense cache: it has codes or padding."""
        if codes is not None:
            return True
        n = cache.lengths[0]
        return cache.biases is not None and any(
            visible_slots(bias[0, :, :n]) is not None for bias in cache.biases
        )

    @classmethod
    def pack(cls, cache: KVCache, codes: QuantizedSegment | None = None) -> PackedCache:
        """Row 0 of `cache`, its first `codes.slots` slots as `codes` where given (the cache
        then holds their dequantized values, as `quantize_prefix` leaves it)."""
        n, q = cache.lengths[0], 0 if codes is None else codes.slots
        layers = []
        for layer in range(cache.num_layers):
            keys, values, bias = cache.read(0, layer)  # [Hkv, n, D], [Hkv, n] or None
            plain = {"k": keys[:, q:], "v": values[:, q:]}
            coded = {}
            if codes is not None:
                coded = {"kq": codes.keys[layer], "vq": codes.values[layer]}
                coded["vs"] = codes.value_scales[layer]
            visible = visible_slots(bias)
            if visible is None:
                part = {name: t.clone() for name, t in (plain | coded).items()}
            else:  # boolean indexing copies: nothing here keeps the cache's buffers alive
                part = squeeze(plain, visible[:, q:])
                part |= squeeze(coded, visible[:, :q].to(codes.keys[layer].device)) if coded else {}
                part["m"] = visible.clone()
            if bias is not None:
                part["b"] = bias.clone() if visible is None else bias[visible]
            if codes is not None:
                part["ks"] = codes.key_scales[layer].clone()
            layers.append(part)
        k0 = cache.keys[0]
        return cls(q, n, cache.logical[0], k0.shape[1], k0.shape[3], k0.dtype, k0.device, layers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self.layers for t in part.values())

    def unpack(self) -> tuple[KVCache, QuantizedSegment | None]:
        """The dense batch-1 cache again, as long as its slots (as one read from disk), and
        the codes of its first slots (None if it has none)."""
        n, q = self.length, self.quantized
        capacity = max(1, n)
        cache = KVCache.allocate(
            len(self.layers), 1, self.heads, self.dim, capacity, self.device, self.dtype
        )
        if "b" in self.layers[0]:
            cache.biases = [
                torch.zeros(1, self.heads, capacity, device=self.device) for _ in self.layers
            ]
        codes = None if q == 0 else QuantizedSegment([], [], [], [])
        for layer, part in enumerate(self.layers):
            if cache.biases is not None:
                cache.biases[layer][0, :, :n] = _slots(part, "b", 0, n, float("-inf"))
            cache.keys[layer][0, :, q:n] = _slots(part, "k", q, n)
            cache.values[layer][0, :, q:n] = _slots(part, "v", q, n)
            if codes is not None:
                codes.keys.append(_slots(part, "kq", 0, q))
                codes.values.append(_slots(part, "vq", 0, q))
                codes.value_scales.append(_slots(part, "vs", 0, q))
                codes.key_scales.append(part["ks"])
        cache.lengths, cache.logical = [n], [self.logical]
        if codes is not None:
            restore(cache, codes)
        return cache, codes


def _slots(part: dict[str, Tensor], name: str, lo: int, hi: int, fill: float = 0.0) -> Tensor:
    """A packed layer's tensor `name` as slots [lo, hi) of every head, [Hkv, hi - lo, ...]:
    its masked slots (if the layer is ragged) filled with `fill`."""
    t, visible = part[name], part.get("m")
    return t if visible is None else unsqueeze(t, visible[:, lo:hi].to(t.device), fill)
