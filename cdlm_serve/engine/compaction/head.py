"""One KV head compacted by any registered method: its keys chosen (`CompactionMethod.select`),
then Attention Matching's fits where the method has them, else the chosen slots kept."""

from __future__ import annotations

import torch
from torch import Tensor

from cdlm_serve.engine.compaction.attention_matching import (
    HeadInputs,
    HeadResult,
    OmpBudget,
    _Clock,
    fit,
    keep,
)
from cdlm_serve.engine.compaction.methods import registry


def select_keys(
    h: HeadInputs,
    t: int,
    method: str,
    generator: torch.Generator | None = None,
    budget: OmpBudget | None = None,
) -> Tensor:
    """[t] the region slots `method` (a registered `CompactionMethod`'s name) keeps."""
    chosen = registry.method(method)
    total = h.keys.shape[0]
    if not 1 <= t <= total:
        raise ValueError(f"target size {t} outside [1, {total}]")
    if chosen.needs_context_queries and h.head_queries is None:
        raise ValueError(f"{method} needs the context's own queries (HeadInputs.head_queries)")
    if h.context_keys and h.head_queries is None:
        raise ValueError("context_keys needs the context's own queries (HeadInputs.head_queries)")
    if chosen.needs_future and h.future is None:
        raise ValueError(f"{method} needs the future queries' statistics")
    return chosen.select(h, t, generator or torch.Generator().manual_seed(0), budget)


def compact_head(
    h: HeadInputs,
    t: int,
    method: str,
    generator: torch.Generator | None = None,
    timings: dict[str, float] | None = None,
    budget: OmpBudget | None = None,
) -> HeadResult:
    """Compact one head to t slots with `method`; stage times add into `timings`; `budget`
    bounds OMP's key selection."""
    clock = _Clock(timings)
    index = select_keys(h, t, method, generator, budget)
    clock.lap("keys")
    chosen = registry.method(method)
    if chosen.fits_beta:
        return fit(h, index, timings, values=chosen.fits_values)
    return keep(h, index)
