"""Attention Matching (Zweiger et al. 2025): keys chosen, then beta and the values fitted so
that the compacted slots answer the reference queries as the whole region did."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdlm_serve.engine.compaction import attention_matching as am
from cdlm_serve.engine.compaction import baselines
from cdlm_serve.engine.compaction.methods.base import CompactionMethod
from cdlm_serve.engine.compaction.methods.registry import register

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from cdlm_serve.engine.compaction.attention_matching import HeadInputs, OmpBudget


class _AttentionMatching(CompactionMethod):
    query_source = "repeat"
    fits_beta = True
    fits_values = True


class Omp(_AttentionMatching):
    """Keys by orthogonal matching pursuit on the attention mass, one at a time."""

    name = "am-omp"

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return am.omp(h, t, budget=budget)


class OmpFast(_AttentionMatching):
    """OMP taking 4 keys an iteration and refitting every 2nd."""

    name = "am-omp-fast"
    banded_on_cpu = True

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return am.omp(h, t, per_iter=4, refit_every=2, budget=budget)


class Highest(_AttentionMatching):
    """The keys with the highest attention (HighestAttnKeys), by the context's queries by
    default (`options.KEY_QUERIES` has the measurement)."""

    name = "am-highest"
    key_queries = ("context", "reference")

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        if h.context_keys:  # the context's own queries rank the keys
            return am.highest_context_attention(h, t)
        return am.highest_attention(h, t)


class HighestFast(Highest):
    """am-highest on the banded repeat pass on a CPU."""

    name = "am-highest-fast"
    banded_on_cpu = True


class H2O(_AttentionMatching):
    """H2O's keys (the context's heavy hitters and the recent slots), beta fitted, their own
    values kept (fitted values do not carry over to later questions there)."""

    name = "am-h2o"
    banded_on_cpu = True
    key_queries = ("context",)
    fits_values = False

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return baselines.h2o(h, t)


for _method in (Omp(), OmpFast(), Highest(), HighestFast(), H2O()):
    register(_method)
