"""What a compaction method is: how it picks a KV head's t slots (`select`), and the traits
the rest of compaction reads instead of testing its name (which queries it takes, whose
attention scores its keys, whether Attention Matching fits beta and the values on them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from cdlm_serve.engine.compaction.attention_matching import HeadInputs, OmpBudget

Scoring = Literal["reference", "context", "none"]


class CompactionMethod:
    """One method, registered under `name` (`registry.register`); one instance serves all."""

    name: ClassVar[str] = ""
    # The reference queries it takes when a request names none: "repeat" (the context
    # repeated, as Attention Matching and KVzip define them) or "context" (its own prefill
    # queries, as the prefill-time baselines score with)...
    query_source: ClassVar[str] = "context"
    # ... and on a CPU the banded repeat pass instead, where the full pass's attention is
    # what it is bound by (on a GPU the band would be a mask over the same attention).
    banded_on_cpu: ClassVar[bool] = False
    # Whose queries score its keys: the reference queries ("reference"), the context's own as
    # at prefill ("context": its query source must be the context), or none ("none": the
    # queries only measure the output error).
    scoring: ClassVar[Scoring] = "reference"
    # Whose attention may rank its keys (`options.KEY_QUERIES`), its default first.
    key_queries: ClassVar[tuple[str, ...]] = ("reference",)
    # Attention Matching's fits on the chosen keys: beta (each slot's mass), then the values.
    fits_beta: ClassVar[bool] = False
    fits_values: ClassVar[bool] = False
    # It reads every reference query of the group, and the row's exact tail after the region
    # (a key's score is its largest attention from any of them: KVzip).
    reads_every_query: ClassVar[bool] = False
    # It needs the statistics of the queries still to come (Expected Attention's RoPE).
    needs_future: ClassVar[bool] = False

    @property
    def needs_context_queries(self) -> bool:
        """Whether its keys are scored by the context's own queries whatever is asked."""
        return self.scoring == "context" or self.key_queries == ("context",)

    def select(
        self,
        h: HeadInputs,
        t: int,
        generator: torch.Generator,
        budget: OmpBudget | None,
    ) -> Tensor:
        """[t] the region slots this head keeps, ascending."""
        raise NotImplementedError

    def scores(self, h: HeadInputs) -> Tensor | None:
        """[T] one score per region key, comparable across heads and layers, whose top t are
        what `select` keeps (`ranks_by_scores`); None for a method that does not select that
        way."""
        return None

    @property
    def ranks_by_scores(self) -> bool:
        """Whether it keeps a head's t best keys by `scores` (budgets="global" needs that)."""
        return type(self).scores is not CompactionMethod.scores
