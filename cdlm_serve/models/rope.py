"""Rotary position embeddings (the "rotate half" layout used by Llama, Qwen, Dream and LLaDA).

Positions are explicit per token, so a sequence can start at any offset: a compacted KV
segment keeps its logical length T and the tokens after it continue from position T.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with Llama-3 or linear scaling applied."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (theta ** (steps / head_dim))
    if scaling is None:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv / factor).float()
    if kind == "llama3":
        return _llama3_scale(inv, factor, scaling).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3_scale(inv: Tensor, factor: float, scaling: dict[str, Any]) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for positions [0, capacity), computed in fp32 once and grown on demand."""

    def __init__(self, inv_freq: Tensor, capacity: int, device: torch.device, dtype: torch.dtype):
        self.inv_freq = inv_freq.to(device)
        self.dtype = dtype
        self.cos = torch.empty(0, device=device, dtype=dtype)
        self.sin = torch.empty(0, device=device, dtype=dtype)
        self._build(capacity)

    def _build(self, capacity: int) -> None:
        t = torch.arange(capacity, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # [S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)

    def ensure(self, capacity: int) -> None:
        """Make positions [0, capacity) available. Callers pass host-side ints, so looking up
        never has to read the position tensor back from the device."""
        if capacity > self.cos.shape[0]:
            self._build(max(capacity, 2 * self.cos.shape[0]))

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, Q] (int64) -> cos, sin [B, Q, 1, D], broadcasting over the heads of a
        [B, Q, heads, D] tensor."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

    def lookup_range(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """The same for one contiguous run shared by the whole batch: [Q, 1, D], no gather."""
        return self.cos[start : start + length, None], self.sin[start : start + length, None]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, Q, heads, D]; cos/sin broadcastable to it ([B, Q, 1, D] or [Q, 1, D])."""
    return x * cos + rotate_half(x) * sin
