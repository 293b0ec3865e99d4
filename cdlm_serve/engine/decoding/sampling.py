"""Sampling parameters and next-token sampling (greedy, temperature, top-p, min-p, seeded), and
the logit adjustments a request may ask for (repetition, presence and frequency penalties, a
logit bias), applied to the rows of a step's logits that ask for them in one pass
(`adjust_logits`)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    # OpenAI's penalties on the answer's tokens so far: `presence_penalty` once a token has
    # appeared, `frequency_penalty` per appearance (subtracted from its logit).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (CTRL's): the logit of a token seen in the prompt or the answer is divided by it
    # when positive, multiplied when negative. 1: off.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to those tokens' logits
    # Tokens less likely than min_p x the most likely one's probability are never drawn.
    min_p: float = 0.0
    # The answer follows a grammar: this answer's own llguidance matcher
    # (`engine.decoding.grammar.Grammars.matcher`), advanced with every token sampled.
    grammar: Any | None = None

    @property
    def biases_logits(self) -> bool:
        """The request penalizes or biases its logits before sampling (`adjust_logits`)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def adjusts_logits(self) -> bool:
        """Its logits change before sampling: biased, or masked by its grammar."""
        return self.biases_logits or self.grammar is not None


@dataclass(slots=True)
class Adjusted:
    """What `adjust_logits` reads of one row: its parameters, its prompt and its answer's token
    counts so far."""

    params: SamplingParams
    prompt: Sequence[int]
    counts: dict[int, int]


def adjust_logits(logits: Tensor, rows: Sequence[Adjusted]) -> Tensor:
    """Each row's penalties and bias on logits [len(rows), V], in one pass over all the rows
    (a few indexed ops on the tokens they name, whatever the batch): the repetition penalty on
    every token of the prompt and the answer, then presence and frequency on the answer's, then
    the bias. Returns float32 logits [len(rows), V] (a new tensor)."""
    out = logits.to(torch.float32, copy=True)  # [k, V]
    device = out.device
    # (row, token, value) triples: the repetition penalty of every token seen, the amount the
    # presence and frequency penalties subtract, the bias added.
    rep_r: list[int] = []
    rep_t: list[int] = []
    rep_p: list[float] = []
    pen_r: list[int] = []
    pen_t: list[int] = []
    pen_v: list[float] = []
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    for r, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = set(row.prompt) | row.counts.keys()
            rep_r += [r] * len(seen)
            rep_t += seen
            rep_p += [p.repetition_penalty] * len(seen)
        if p.presence_penalty or p.frequency_penalty:
            for tok, n in row.counts.items():
                pen_r.append(r)
                pen_t.append(tok)
                pen_v.append(p.presence_penalty + p.frequency_penalty * n)
        for tok, b in p.logit_bias.items():
            bias_r.append(r)
            bias_t.append(tok)
            bias_v.append(b)
    if rep_r:
        idx = (torch.tensor(rep_r, device=device), torch.tensor(rep_t, device=device))
        penalty = torch.tensor(rep_p, device=device)
        seen_logits = out[idx]
        out[idx] = torch.where(seen_logits > 0, seen_logits / penalty, seen_logits * penalty)
    for rs, ts, vs, sign in ((pen_r, pen_t, pen_v, -1.0), (bias_r, bias_t, bias_v, 1.0)):
        if rs:
            idx = (torch.tensor(rs, device=device), torch.tensor(ts, device=device))
            out.index_put_(idx, sign * torch.tensor(vs, device=device), accumulate=True)
    return out


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
    if params.min_p > 0.0:
        probs = _min_p_filter(probs, params.min_p)
    return draw(probs, generator)


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of `probs` [B, V] (non-negative weights, any sum > 0) -> [B] int64,
    each with its weight's share of the row's sum: the inverse of the row's cumulative
    distribution at one uniform draw. `torch.multinomial` draws the same distribution at ~15x
    the cost on a CPU (1.3 ms against 80 us for a 49K vocabulary on one core here: a quarter of
    a sampled decode step at 8 rows), and syncs on CUDA. A token of weight 0 (a grammar's mask,
    a filter) is never drawn: adding 0 leaves a cumulative sum as it was, so the first one
    above the draw is a positive weight's. float32 sums, as samplers on GPUs keep them: a
    weight under float32's resolution at 1 (6e-8 of the row's sum) may round away."""
    cdf = probs.float().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    u = torch.rand(total.shape, generator=generator, device=probs.device) * total  # [B, 1]
    # Below the total, even where u * total rounds up to it: at most the last positive weight.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [B]


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


def _min_p_filter(probs: Tensor, min_p: float) -> Tensor:
    """Drop the tokens less likely than min_p x the most likely one (which always stays)."""
    floor = min_p * probs.max(dim=-1, keepdim=True).values  # [B, 1]
    kept = probs.masked_fill(probs < floor, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)
