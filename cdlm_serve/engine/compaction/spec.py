"""What a compaction is asked to do (`CompactionSpec`), checked once where it enters, and how
one runs (`CompactionRuntime`: the callbacks and inputs of the process running it).

One spec serves every entry: a requested compaction (`POST /v1/sessions/{id}/compact`, the
Responses API's `compact`), a session's online policy (`AutoCompact` holds one), the benches
and the tests. Its checks are the only ones (`SpecError` names the request parameter at
fault), and `target(physical)` is the only place a ratio becomes a number of slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.engine.compaction.methods import method
from cdlm_serve.engine.compaction.options import (
    BUDGETS,
    QUERY_SOURCES,
    default_query_source,
    resolve_key_queries,
)
from cdlm_serve.engine.model_work import OnEngine, inline

# A compaction must shrink what it compacts at least this much: smaller gains are not worth
# a fit, and a ratio near 1 would ask OMP for almost every key.
MIN_RATIO = 1.5
QUANTIZATIONS = ("int8",)


class SpecError(ValueError):
    """A compaction that cannot be done as asked; `param` is the request's field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CompactionSpec:
    """Compact the slots before the newest `keep_recent` to `target_tokens` slots, or by
    `ratio` (slots before / after over that region), with `method`."""

    method: str = "am-highest"
    ratio: float | None = None
    target_tokens: int | None = None
    query_source: str | None = None  # None: the method's own (on the model's device)
    keep_recent: int = 0
    quantize: str | None = None  # "int8": the compacted segment kept as int8 codes
    budgets: str = "uniform"  # "attention", "measured": slots per KV head (budgets.py)
    key_queries: str | None = None  # whose attention ranks the keys; None: the method's own
    # The least gain a compaction must make; below MIN_RATIO only for benches and tests that
    # compact to an exact size (`exact`).
    min_ratio: float = field(default=MIN_RATIO, compare=False)

    def __post_init__(self) -> None:
        try:
            chosen = method(self.method)
        except ValueError as e:
            raise SpecError(str(e), "method") from None
        if self.ratio is not None and (
            not math.isfinite(self.ratio) or self.ratio < self.min_ratio
        ):
            raise SpecError(f"ratio must be at least {self.min_ratio}", "ratio")
        if self.target_tokens is not None and self.target_tokens < 1:
            raise SpecError("target_tokens must be at least 1", "target_tokens")
        if self.query_source is not None and self.query_source not in QUERY_SOURCES:
            raise SpecError(
                f"unknown query source {self.query_source!r}; known: {', '.join(QUERY_SOURCES)}",
                "query_source",
            )
        if chosen.scoring == "context" and self.query_source not in (None, "context"):
            raise SpecError(
                f"{self.method} scores keys with the context's own queries: query_source must "
                f"be 'context', not {self.query_source!r}",
                "query_source",
            )
        if self.keep_recent < 0:
            raise SpecError("keep_recent must be at least 0", "keep_recent")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise SpecError(
                f"unknown quantization {self.quantize!r}; known: {', '.join(QUANTIZATIONS)}",
                "quantize",
            )
        if self.budgets not in BUDGETS:
            raise SpecError(
                f"unknown budgets {self.budgets!r}; known: {', '.join(BUDGETS)}", "budgets"
            )
        if self.budgets == "attention" and self.query_source == "on-policy":
            raise SpecError(
                "budgets by attention need every layer's queries first: not on-policy", "budgets"
            )
        if self.budgets == "global" and self.query_source == "on-policy":
            raise SpecError(
                "global budgets need every layer's scores first: not on-policy", "budgets"
            )
        if self.budgets == "global" and not chosen.ranks_by_scores:
            raise SpecError(
                f"global budgets share slots by a method's key scores: {self.method!r} keeps "
                "no top-scored keys (kvzip does)",
                "budgets",
            )
        try:
            resolve_key_queries(self.method, self.key_queries)
        except ValueError as e:
            raise SpecError(str(e), "key_queries") from None

    @classmethod
    def exact(cls, target_tokens: int, **options: Any) -> CompactionSpec:
        """Exactly `target_tokens` slots, whatever the gain (benches and tests)."""
        return cls(target_tokens=target_tokens, min_ratio=1.0, **options)

    def region(self, physical: int) -> int:
        """The slots it compacts of a row of `physical` slots (SpecError if too few)."""
        region = physical - self.keep_recent
        if region < 2:
            raise SpecError(
                f"keep_recent={self.keep_recent} leaves too little of the {physical} cached "
                "tokens to compact",
                "keep_recent",
            )
        return region

    def target(self, physical: int) -> int:
        """The slots the region of a row of `physical` slots gets (SpecError if it cannot)."""
        region = self.region(physical)
        if self.target_tokens is not None:
            if self.target_tokens * self.min_ratio > region:
                raise SpecError(
                    f"target_tokens={self.target_tokens} must be at most 1/{self.min_ratio} of "
                    f"the {region} tokens to compact",
                    "target_tokens",
                )
            return self.target_tokens
        if self.ratio is None:
            raise SpecError("a compaction needs ratio or target_tokens", "ratio")
        target = max(1, math.ceil(region / self.ratio))
        if target >= region:
            raise SpecError(f"ratio={self.ratio} leaves the {region} tokens as they are", "ratio")
        return target

    def source_on(self, device: torch.device) -> str:
        """The reference queries it takes on `device`."""
        return self.query_source or default_query_source(self.method, device)

    def ranking(self) -> str:
        """Whose attention ranks its keys (KEY_QUERIES)."""
        return resolve_key_queries(self.method, self.key_queries)


@dataclass(frozen=True, slots=True)
class CompactionRuntime:
    """How one compaction runs: in the server, on the model's engine thread and the compaction
    thread's core share; in a bench or a test, right here (the defaults)."""

    tokenizer: Any = None  # for the repeat and self-study prompts
    seed: int = 0
    max_queries: int = 2048  # reference queries each KV head fits at most
    on_engine: OnEngine[Any] = inline  # runs a piece of model work where the model may be used
    on_fit: OnEngine[Any] = inline  # runs a layer's fit (the server's core share)
    omp_budget: float | None = None  # seconds OMP's key selection may take, all layers
    urgent: Callable[[], bool] | None = None  # whether the model's requests wait for pieces
    reference: list[Tensor] | None = None  # the source's queries, captured before on this row
    schedule: list[list[float]] | None = None  # the model's measured budget schedule
    segment_slots: int | None = None  # the row's last compaction's segment, if any
    longest: int | None = None  # the most slots one KV head may keep (AutoCompact.longest)
