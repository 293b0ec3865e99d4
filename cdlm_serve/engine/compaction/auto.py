"""Online compaction: a session that keeps itself under a physical size.

A session created with a policy (`AutoCompact`) compacts its older part by itself whenever an
append (a create's prompt, a completion with `append`) has taken its cache past `max_tokens`
physical slots: the slots before the last `keep_recent` are compacted `ratio`x with `method`.
It happens between requests, never inside one: the server starts it once the request that
grew the session has been committed and its lock released, and the compaction then holds the
lock like any other (`server/routes/sessions.py`). Compacted slots are compacted again when the
session grows past the bound again (Attention Matching composes: the old biases are part of
what the next fit matches), so a session can grow to many times `max_tokens` logical tokens
while its cache stays near that size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from cdlm_serve.engine.compaction.methods import METHODS
from cdlm_serve.engine.compaction.options import BUDGETS, QUERY_SOURCES, resolve_key_queries

MIN_RATIO = 1.5  # as a requested compaction: smaller gains are not worth one
MIN_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class AutoCompact:
    max_tokens: int  # physical slots the cache may hold before it is compacted
    ratio: float  # slots before / after, over the compacted region
    method: str = "am-highest-fast"
    keep_recent: int = 0  # the newest slots, kept exact
    query_source: str | None = None  # None: the method's own
    quantize: str | None = None  # "int8": the compacted segment as int8 codes (kv_quant)
    budgets: str = "uniform"  # "attention", "measured": per KV head (compaction_budgets)
    key_queries: str | None = None  # whose attention ranks am-highest's keys; None: its own

    def __post_init__(self) -> None:
        if self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(f"max_tokens must be at least {MIN_MAX_TOKENS}")
        if not math.isfinite(self.ratio) or self.ratio < MIN_RATIO:
            raise ValueError(f"ratio must be at least {MIN_RATIO}")
        if self.method not in METHODS:
            raise ValueError(f"unknown compaction method {self.method!r}")
        if self.query_source is not None and self.query_source not in QUERY_SOURCES:
            raise ValueError(f"unknown query source {self.query_source!r}")
        if self.quantize not in (None, "int8"):
            raise ValueError(f"unknown quantization {self.quantize!r}")
        if self.budgets not in BUDGETS:
            raise ValueError(f"unknown budgets {self.budgets!r}")
        if self.budgets == "attention" and self.query_source == "on-policy":
            raise ValueError("budgets by attention are not for on-policy queries")
        resolve_key_queries(self.method, self.key_queries)  # kept as given: None stays None
        if not 0 <= self.keep_recent <= self.max_tokens // 2:
            # Else a compaction could not bring the cache back under max_tokens.
            raise ValueError("keep_recent must be between 0 and max_tokens / 2")

    def due(self, physical: int) -> bool:
        """Whether a cache of `physical` slots is to be compacted now."""
        return physical > self.max_tokens

    def target(self, physical: int) -> int | None:
        """Slots the compacted region gets (as a compaction requested with this `ratio`), or
        None where that would not shrink it."""
        region = physical - self.keep_recent
        target = max(1, math.ceil(region / self.ratio))
        return target if target < region else None

    def longest(self, target: int) -> int:
        """The most slots one KV head may keep when non-uniform budgets split `target` per
        head: half the room above the kept recent slots (never under `target`). The row is
        as long as its longest head, so without it a head may keep its whole region (8t, a
        measured schedule's most, is all of it below 8x) and the row would never shrink:
        every append past max_tokens would compact again, and the row grow without end."""
        return max(target, (self.max_tokens - self.keep_recent) // 2)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> AutoCompact | None:
        if obj is None:
            return None
        return cls(
            max_tokens=int(obj["max_tokens"]),
            ratio=float(obj["ratio"]),
            method=str(obj.get("method", "am-highest-fast")),
            keep_recent=int(obj.get("keep_recent", 0)),
            query_source=obj.get("query_source"),
            quantize=obj.get("quantize"),
            budgets=str(obj.get("budgets", "uniform")),
            key_queries=obj.get("key_queries"),
        )
