"""int8 session caches: a compacted segment kept as 8-bit integers with scales (KIVI-style).

A compacted segment (the first t slots of a session's cache after a compaction) is stored as
int8 codes: keys with one scale per channel of each KV head (KIVI's observation: key outliers
sit in fixed channels, so a per-channel scale keeps them without wasting the others' range),
values with one scale per token (their error then stays proportional to each token's own
magnitude). Symmetric absmax quantization, x ~ q * scale with q in [-127, 127], so every
element is within scale / 2 of its original. The per-key biases (beta) stay fp32.

The codes are the segment's truth from its compaction on: the session's dense cache holds
their dequantized values (what every request computes with), the disk holds the codes
(`engine/sessions/files.py`), and an idle session in memory holds only the codes and the rest of
its cache (`engine.sessions.packed_cache`), unpacked when next used. At 64-wide heads the codes and
scales take 0.52x of bf16 and 0.26x of fp32 for keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cdlm_serve.models.kv_cache import KVCache

LEVELS = 127


@dataclass(slots=True)
class QuantizedSegment:
    """Slots [0, slots) of a batch-1 cache as int8 codes, per layer."""

    keys: list[Tensor]  # int8 [Hkv, t, D]
    key_scales: list[Tensor]  # fp32 [Hkv, 1, D], one per channel
    values: list[Tensor]  # int8 [Hkv, t, D]
    value_scales: list[Tensor]  # fp32 [Hkv, t, 1], one per token

    @property
    def slots(self) -> int:
        return self.keys[0].shape[1]

    def nbytes(self) -> int:
        tensors = (*self.keys, *self.key_scales, *self.values, *self.value_scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer(self, layer: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """The layer's dequantized keys and values [Hkv, t, D]."""
        keys = self.keys[layer].float() * self.key_scales[layer]
        values = self.values[layer].float() * self.value_scales[layer]
        return keys.to(device=device, dtype=dtype), values.to(device=device, dtype=dtype)


def _codes(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """x [Hkv, t, D] -> (int8 codes, fp32 scales reduced over `dim`, kept as size 1)."""
    scale = x.float().abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / LEVELS
    return torch.round(x.float() / scale).clamp(-LEVELS, LEVELS).to(torch.int8), scale


def quantize_prefix(cache: KVCache, slots: int, row: int = 0) -> QuantizedSegment:
    """Quantize the first `slots` slots of a cache row (keys per channel, values per token)
    and put their dequantized values back in place, so that the cache computes exactly what
    the codes hold from now on. Returns the codes (on the CPU)."""
    keys, values, key_scales, value_scales = [], [], [], []
    for layer in range(cache.num_layers):
        k, v, _ = cache.read(row, layer)  # [Hkv, n, D]
        kq, ks = _codes(k[:, :slots].cpu(), dim=1)  # scales [Hkv, 1, D]
        vq, vs = _codes(v[:, :slots].cpu(), dim=2)  # scales [Hkv, t, 1]
        keys.append(kq)
        key_scales.append(ks)
        values.append(vq)
        value_scales.append(vs)
    segment = QuantizedSegment(keys, key_scales, values, value_scales)
    restore(cache, segment, row)
    return segment


def restore(cache: KVCache, segment: QuantizedSegment, row: int = 0) -> None:
    """Write the segment's dequantized keys and values into slots [0, t) of a cache row."""
    t = segment.slots
    for layer in range(cache.num_layers):
        k_buf, v_buf = cache.keys[layer], cache.values[layer]
        keys, values = segment.layer(layer, k_buf.dtype, k_buf.device)
        k_buf[row, :, :t] = keys
        v_buf[row, :, :t] = values
