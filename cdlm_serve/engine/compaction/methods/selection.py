"""Token selection: the baselines that keep t of a head's slots as they are (keys, values and
bias), each as its paper scores them (`engine.compaction.baselines`)."""

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


class SnapKV(CompactionMethod):
    name = "snapkv"
    scoring = "context"

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return baselines.snapkv(h, t)


class H2O(CompactionMethod):
    name = "h2o"
    scoring = "context"

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return baselines.h2o(h, t)


class Streaming(CompactionMethod):
    name = "streaming"
    scoring = "none"

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return baselines.streaming(h.keys.shape[0], t)


class ExpectedAttention(CompactionMethod):
    name = "expected_attention"
    scoring = "context"
    needs_future = True

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return baselines.expected_attention(h, t)


class KVzip(CompactionMethod):
    """Keys by their largest attention from any repeat-the-context query (Kim et al. 2025)."""

    name = "kvzip"
    query_source = "repeat"
    banded_on_cpu = True
    reads_every_query = True

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        scores = h.scores if h.scores is not None else self.scores(h)
        return scores.topk(t).indices.sort().values

    def scores(self, h: HeadInputs) -> Tensor:
        return am.repeat_max_scores(h)


class Random(CompactionMethod):
    name = "random"
    scoring = "none"

    def select(
        self, h: HeadInputs, t: int, generator: torch.Generator, budget: OmpBudget | None
    ) -> Tensor:
        return baselines.random_keys(h.keys.shape[0], t, generator)


for _method in (SnapKV(), H2O(), Streaming(), ExpectedAttention(), KVzip(), Random()):
    register(_method)
