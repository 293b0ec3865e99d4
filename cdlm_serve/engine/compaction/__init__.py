"""Compaction: a session's KV cache made smaller by Attention Matching or a baseline.

What the other subsystems use is exported here (the server, the sessions, the served model);
the modules inside are the algorithm's parts, for this package, the benches and the tests:
`options` (what can be asked), `queries` (reference queries), `attention_matching` and `nnls`
(the per-head fit), `spec` (what a compaction is asked: `CompactionSpec`), `baselines`, `budgets`
(slots per KV head), `row` (one row end to end: `compact_row`), `auto` (a session's online policy),
`kv_quant` (a segment as int8 codes), `methods/` (one object per method: its traits and how it
picks a head's slots).
"""

from cdlm_serve.engine.compaction.auto import AutoCompact
from cdlm_serve.engine.compaction.budgets import SCHEDULE_MOST, load_schedule, schedule_name
from cdlm_serve.engine.compaction.kv_quant import QuantizedSegment
from cdlm_serve.engine.compaction.methods import (
    METHODS,
    CompactionMethod,
    register_method,
    unregister_method,
)
from cdlm_serve.engine.compaction.options import (
    AUTO,
    BUDGETS,
    KEY_QUERIES,
    QUERY_SOURCES,
    default_key_queries,
    resolve_auto,
    resolve_key_queries,
)
from cdlm_serve.engine.compaction.queries import reference_queries
from cdlm_serve.engine.compaction.row import CompactionReport, compact_row
from cdlm_serve.engine.compaction.spec import (
    MIN_RATIO,
    CompactionRuntime,
    CompactionSpec,
    SpecError,
)

__all__ = [
    "AUTO",
    "BUDGETS",
    "KEY_QUERIES",
    "METHODS",
    "MIN_RATIO",
    "QUERY_SOURCES",
    "SCHEDULE_MOST",
    "AutoCompact",
    "CompactionMethod",
    "CompactionReport",
    "CompactionRuntime",
    "CompactionSpec",
    "QuantizedSegment",
    "SpecError",
    "compact_row",
    "default_key_queries",
    "load_schedule",
    "reference_queries",
    "register_method",
    "resolve_auto",
    "resolve_key_queries",
    "schedule_name",
    "unregister_method",
]
