"""An idle session's cache as it rests in memory: without its padding, its segment as codes.

A session between requests needs its cache again only when its next request comes, so the
store (`SessionStore.enforce_limit`) keeps an idle one in the form that takes the fewest bytes
and unpacks it then (`SessionStore.load`): the tensors its segment files hold
(`session_files.segment_tensors`), in memory. So

- the padding slots of non-uniform budgets (`engine.sessions.ragged`) are dropped: each layer holds
its
  heads' visible slots only, and the mask of which they are, so a budget schedule that moves
  slots between heads costs no memory at rest (only while a request runs, in the rectangular
  batch cache);
- a compacted segment that was quantized (`engine.compaction.kv_quant`) is held as its int8 codes
and
  scales, the segment's truth since its compaction, not as its dequantized values.

Unpacking (`session_files.cache_from_parts`, as a read from disk) gives back the dense cache
and the codes that were packed, slot for slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cdlm_serve.engine.compaction import QuantizedSegment
from cdlm_serve.engine.sessions.ragged import visible_slots
from cdlm_serve.engine.sessions.segment_tensors import cache_from_parts, segment_tensors
from cdlm_serve.models.kv_cache import KVCache


@dataclass(slots=True)
class PackedCache:
    """A batch-1 cache's committed slots as the named tensors of its segments: slots [0, q)
    as `codes` where quantized, then the rest."""

    parts: list[dict[str, Tensor]]
    length: int  # n, the physical slots
    logical: int
    quantized: int  # q: slots [0, q) are held as int8 codes (0: none)
    dtype: torch.dtype
    device: torch.device

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
        parts = [segment_tensors(cache, 0, q, codes)] if q else []
        if n > q:
            parts.append(segment_tensors(cache, q, n))
        # Copies: a part may be a view of the cache, whose buffers must not be kept alive.
        owned = [{name: t.clone() for name, t in part.items()} for part in parts]
        k0 = cache.keys[0]
        return cls(owned, n, cache.logical[0], q, k0.dtype, k0.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self.parts for t in part.values())

    def unpack(self) -> tuple[KVCache, QuantizedSegment | None]:
        """The dense batch-1 cache again, as long as its slots (as one read from disk), and
        the codes of its first slots (None if it has none)."""
        return cache_from_parts(self.parts, self.length, self.logical, self.device, self.dtype)
