"""Which masked positions of a block one denoising step finalizes: the confidence of each
candidate token, and (for scheduled decoding) how many positions a step takes.

The names and the arithmetic are those of the public reference decoders, which
`tests/test_dlm_reference.py` checks token for token:
- confidences: LLaDA's `remasking` (`low_confidence`: the chosen token's probability; `random`)
  and Dream's `alg` (`maskgit_plus`: the probability; `topk_margin`: top-1 minus top-2
  probability; `entropy`: the negative entropy of the distribution);
- schedules of a fixed number of steps per block: LLaDA's `get_num_transfer_tokens` (a block's
  masks split evenly over its steps, the remainder to the earliest ones) and Dream's (step i of
  s takes int(masks left * (1 - t[i+1] / t[i])) of t = linspace(1, 1e-3, s + 1), the last step
  takes the rest; computed in fp32 as Dream does, so some steps take none).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

# "origin" is Dream's rule without a confidence: each masked position is finalized with
# probability 1 - t[i+1] / t[i] (Dream's schedule), from one draw per masked position.
Confidence = Literal["probability", "margin", "entropy", "random", "origin"]
Schedule = Literal["llada", "dream"]

# The names the reference releases use for our confidences.
DREAM_ALGS: dict[str, Confidence] = {
    "maskgit_plus": "probability",
    "topk_margin": "margin",
    "entropy": "entropy",
    "origin": "origin",
}
LLADA_REMASKING: dict[str, Confidence] = {"low_confidence": "probability", "random": "random"}
DREAM_EPS = 1e-3  # Dream's final timestep


def confidence(
    kind: Confidence,
    probs: Tensor,
    tokens: Tensor,
    random: Tensor | None = None,
) -> Tensor:
    """probs [B, V] fp32 over the whole vocabulary, tokens [B] chosen -> confidence [B]
    (higher is surer). `random` [B]: the draws of `random` confidence."""
    if kind == "probability":
        return probs.gather(-1, tokens[:, None]).squeeze(-1)
    if kind == "margin":
        top2 = probs.topk(2, dim=-1).values  # [B, 2]
        return top2[:, 0] - top2[:, 1]
    if kind == "entropy":
        return (probs * torch.log(probs + 1e-10)).sum(dim=-1)  # Dream's epsilon
    if kind == "random":
        assert random is not None, "random confidence needs its draws"
        return random
    raise ValueError(f"unknown confidence {kind!r}")


def quota(schedule: Schedule, masked: int, block_size: int, step: int, steps: int) -> int:
    """How many positions step `step` (0-based) of a block's `steps` finalizes, `masked` of
    the block's positions still being masked (LLaDA's counts depend only on the block size:
    its blocks start fully masked)."""
    if step >= steps - 1:
        return masked  # the last step takes what is left
    if schedule == "llada":
        base, extra = divmod(block_size, steps)
        return min(masked, base + (1 if step < extra else 0))
    t = _timesteps(steps)
    left = torch.tensor(masked) / 1  # Dream's mask_index.sum() / batch: an fp32 tensor
    return int(left * (1 - t[step + 1] / t[step]))


def origin(masked: Tensor, step: int, steps: int, generator: torch.Generator | None) -> Tensor:
    """Dream's `origin`: masked [B] bool -> bool [B], each masked position finalized with
    probability 1 - t[i+1] / t[i] (all of them at the last step), one draw per masked
    position in order, drawn at every step as Dream does."""
    draws = torch.rand(int(masked.sum()), generator=generator, device=masked.device)
    t = _timesteps(steps)
    p = 1 - t[step + 1] / t[step] if step < steps - 1 else torch.tensor(1.0)
    chosen = torch.zeros_like(masked)
    chosen[masked] = draws < p.to(masked.device)
    return chosen


def _timesteps(steps: int) -> Tensor:
    """Dream's t = linspace(1, eps, steps + 1), fp32 on the CPU (as Dream computes it)."""
    return torch.linspace(1, DREAM_EPS, steps + 1)


def pick(conf: Tensor, k: int, temperature: float, generator: torch.Generator | None) -> Tensor:
    """conf [B] (-inf where not a candidate) -> bool [B]: the k most confident positions, or
    (Dream's `alg_temp` > 0) k drawn with probability softmax(conf / temperature)."""
    chosen = torch.zeros(conf.shape, dtype=torch.bool, device=conf.device)
    if k <= 0:
        return chosen
    if temperature > 0:
        candidates = conf > float("-inf")
        # Shifted by the max first, in float64 (which holds any temperature a request can send,
        # down to 5e-324): no temperature, however small, gives inf or 0/0 (NaN).
        weights = torch.softmax((conf - conf.max()).double() / temperature, dim=-1)
        # Every candidate keeps a chance: a small temperature underflows weights to 0, and k
        # draws without replacement from fewer than k non-zero weights would fail the step.
        weights = torch.where(candidates, weights.clamp_min(torch.finfo(weights.dtype).tiny), 0)
        index = torch.multinomial(weights, k, generator=generator)
    else:
        index = torch.topk(conf, k).indices
    chosen[index] = True
    return chosen
