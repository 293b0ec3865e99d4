"""Sampling parameters and next-token sampling (greedy, temperature, top-p, seeded)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cdlm_serve.models import kernels


@dataclass(slots=True)
class GenerationParams:
    """What every request asks of either engine: how long, how random, where to stop."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """Token ids that end the answer: the request's own, and end-of-text unless ignored."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= eos_token_ids
        return frozenset(ids)


@dataclass(slots=True)
class SamplingParams(GenerationParams):
    """An autoregressive request. `max_tokens` 0 is a prefill: the prompt goes into the row
    (and the session's cache it continues), nothing is sampled."""

    logprobs: int | None = None  # report each token's logprob and this many top alternatives
    # Report each prompt token's logprob (the first has none) and this many top alternatives,
    # computed as the prompt is prefilled (its prefix is then never taken from the cache).
    prompt_logprobs: int | None = None
    # Prefix-cache blocks are shared only between requests with the same salt (vLLM's
    # cache_salt: tenants cannot probe each other's prompts through cache timing).
    cache_salt: str | None = None


def eos_token_ids(config_eos: list[int], tokenizer: object) -> frozenset[int]:
    """End-of-text ids: the model config's and the tokenizer's (they may differ)."""
    eos = set(config_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)  # tokenizers without one have None
    if tok_eos is not None:
        eos.add(int(tok_eos))
    return frozenset(eos)


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


# Temperatures below this divide as this. A request may send any t > 0, down to 5e-324, but as
# a float32 scalar 1e-120 is 0, and logits / 0 are inf whose softmax is NaN. Logits whose gap
# is above float32's resolution are already one-hot apart at 1e-20 (a gap of 1e-6 is 1e14
# there), so the floor changes no distribution, and a logit would have to pass 3e18 for the
# division to overflow. The hot path stays one float32 division and softmax.
TEMPERATURE_FLOOR = 1e-20


def tempered_softmax(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / temperature) over the last dim, never inf or NaN for a temperature
    > 0 (TEMPERATURE_FLOOR): the smallest give the greedy choice."""
    return torch.softmax(logits / max(temperature, TEMPERATURE_FLOOR), dim=-1)


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)
