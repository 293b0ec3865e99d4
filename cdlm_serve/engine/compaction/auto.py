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

from dataclasses import dataclass
from typing import Any

from cdlm_serve.engine.compaction.options import AUTO, resolve_auto
from cdlm_serve.engine.compaction.spec import CompactionSpec, SpecError

MIN_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class AutoCompact:
    max_tokens: int  # physical slots the cache may hold before it is compacted
    spec: CompactionSpec  # what each compaction does (by its ratio)

    def __post_init__(self) -> None:
        if self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(f"max_tokens must be at least {MIN_MAX_TOKENS}")
        if self.spec.ratio is None or self.spec.target_tokens is not None:
            raise ValueError("an online compaction is by ratio")
        if not 0 <= self.spec.keep_recent <= self.max_tokens // 2:
            # Else a compaction could not bring the cache back under max_tokens.
            raise ValueError("keep_recent must be between 0 and max_tokens / 2")

    @classmethod
    def of(
        cls,
        max_tokens: int,
        ratio: float,
        method: str = AUTO,
        budgets: str | None = None,
        **options: Any,
    ) -> AutoCompact:
        """A policy from its flat options (a request's `auto_compact`, a session's file);
        `auto` is resolved here, so a session's file keeps the method it compacts with."""
        name, budgets = resolve_auto(method, budgets, options.get("query_source"))
        spec = CompactionSpec(method=name, ratio=ratio, budgets=budgets, **options)
        return cls(max_tokens, spec)

    def due(self, physical: int) -> bool:
        """Whether a cache of `physical` slots is to be compacted now."""
        return physical > self.max_tokens

    def target(self, physical: int) -> int | None:
        """Slots the compacted region gets (as a compaction requested with this ratio), or
        None where that would not shrink it."""
        try:
            return self.spec.target(physical)
        except SpecError:
            return None

    def longest(self, target: int) -> int:
        """The most slots one KV head may keep when non-uniform budgets split `target` per
        head: half the room above the kept recent slots (never under `target`). The row is
        as long as its longest head, so without it a head may keep its whole region (8t, a
        measured schedule's most, is all of it below 8x) and the row would never shrink:
        every append past max_tokens would compact again, and the row grow without end."""
        return max(target, (self.max_tokens - self.spec.keep_recent) // 2)

    def to_json(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "max_tokens": self.max_tokens,
            "ratio": spec.ratio,
            "method": spec.method,
            "keep_recent": spec.keep_recent,
            "query_source": spec.query_source,
            "quantize": spec.quantize,
            "budgets": spec.budgets,
            "key_queries": spec.key_queries,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> AutoCompact | None:
        if obj is None:
            return None
        return cls.of(
            max_tokens=int(obj["max_tokens"]),
            ratio=float(obj["ratio"]),
            method=str(obj.get("method", "am-highest-fast")),
            keep_recent=int(obj.get("keep_recent", 0)),
            query_source=obj.get("query_source"),
            quantize=obj.get("quantize"),
            budgets=str(obj.get("budgets", "uniform")),
            key_queries=obj.get("key_queries"),
        )
