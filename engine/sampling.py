"""Sampling parameters and next-token sampling (greedy, temperature, top-p, seeded)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models import kernels


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's logprob and this many top alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator: the same seed and request give the same text."""
    gen = torch.Generator(device=device)
    # Any int64 seed, plus the offsets of a request's n choices, maps into torch's range.
    gen.manual_seed(seed % 2**64 if seed is not None else secrets.randbits(63))
    return gen


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] (int64)."""
    if params.greedy:
        return kernels.argmax(logits)
    probs = tempered_softmax(logits.float(), params.temperature)  # [B, V]
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def tempered_softmax(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / temperature) over the last dim, in the logits' dtype: shifted by the
    max first and divided in float64, which holds any temperature a request can send (down to
    5e-324; as a float32 scalar 1e-120 is 0, and 0 / 0 is NaN). Shifted, the best tokens score
    0 and the others -inf at worst: the greedy choice, never inf or NaN."""
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(shifted.double() / temperature, dim=-1).to(logits.dtype)


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)
