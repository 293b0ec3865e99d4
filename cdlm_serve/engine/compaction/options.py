"""What a compaction can be asked for: its reference-query sources, key rankings and budgets,
each method's defaults (a request's combination is checked by `spec.CompactionSpec`)."""

from __future__ import annotations

import torch

from cdlm_serve.engine.compaction.methods import METHODS, method

QUERY_SOURCES = (
    "context",
    "repeat",
    "repeat-banded",
    "self-study",
    "repeat+self-study",
    "on-policy",
)
REPEAT_WINDOW = 512  # repeat-banded: the slots either side of a repeated token's original
REPEAT_ROWS = 256  # repeat-banded: repeated tokens per block (all see the same keys)
# The most context tokens one repeat pass reads: a longer history is read as pieces of
# REPEAT_PIECE tokens spread evenly over it (its last piece always), so the time a compaction
# takes stops growing with the session's history (online compaction compacts again and again).
# The fits take at most max_queries (2,048) of the pooled queries, ~700 tokens' worth at 3 query
# heads per KV head. 4,096 cost am-h2o 0.61 -> 0.54 of the facts on bench.online_compaction's
# first context (8K; am-highest-fast 0.52 both, compaction 21-26% faster); at 8,192 nothing
# within SmolLM2's 8K context changes, and past it a compaction costs what one at 8K does.
REPEAT_BUDGET = 8192
REPEAT_PIECE = 512  # a multiple of REPEAT_ROWS: a piece's blocks line up as in the whole pass
# Slots per KV head: all alike, by measured attention, or by the model's measured schedule.
BUDGETS = ("uniform", "attention", "measured", "global")
# Whose attention ranks the keys of the am-highest variants: the reference queries they are
# fitted on ("reference", the paper's HighestAttnKeys), or the context's own ("context", the
# paper's context-prefill queries: each KV head ranks by its group's queries at max_queries /
# group seeded random positions of the context, `context_key_queries`, which re-reads just
# those tokens from the row's cache; beta and the values stay fitted on the reference
# queries). Facts kept, 2K contexts, medians of 5, Austen | the Python reference, 10x / 20x
# (`python -m cdlm_serve.bench.compaction [--text python-reference] --contexts 5 --lengths 2048
# --ratios 10 20 --methods am-highest am-highest-fast h2o`; +refkeys for the reference's):
# am-highest 0.36 | 0.45 / 0.16 | 0.22 by the reference -> 0.58 | 0.52 / 0.48 | 0.33
# by the context; am-highest-fast 0.44 | 0.45 / 0.17 | 0.30 -> 0.56 | 0.53 / 0.43 |
# 0.32; H2O, the best baseline, 0.53 | 0.46 / 0.25 | 0.17. The repeat queries mostly read
# the token each one copies; later questions read the keys the context's own queries did.
# (Fitting beta and the values on the context queries too is what does not carry over:
# continuation probe down to -17.) The price, at 4K tokens on 2 cores (fp32, AVX2,
# `--timing`, two runs each, alternating): am-highest-fast 29.6 / 28.3 s by the reference,
# 34.5 / 34.1 s by the context (a causal pass over the whole context instead: 47.9 / 55.1 s).
KEY_QUERIES = ("context", "reference")


def default_key_queries(name: str) -> str:
    """Whose attention ranks `name`'s keys when a request names none (KEY_QUERIES): the
    context's, for the methods that can (`CompactionMethod.key_queries`, its default first)."""
    return method(name).key_queries[0]


def resolve_key_queries(name: str, key_queries: str | None) -> str:
    """`key_queries` checked for method `name` (ValueError if unknown or not for it), or the
    method's own where None."""
    chosen = method(name)
    key_queries = key_queries or chosen.key_queries[0]
    if key_queries not in KEY_QUERIES:
        raise ValueError(f"unknown key_queries {key_queries!r}; known: {', '.join(KEY_QUERIES)}")
    if key_queries not in chosen.key_queries:
        if key_queries == "reference":
            raise ValueError(f"{name}'s keys are ranked by the context's queries only")
        able = [m.name for m in METHODS.values() if "context" in m.key_queries]
        raise ValueError(f"key_queries='context' ranks the keys of {', '.join(able)}, not {name}'s")
    return key_queries


# Each method's reference queries when a request names none (`CompactionMethod.query_source`:
# what its paper uses, Attention Matching and KVzip the repeat-the-context queries, the
# prefill-time baselines the context's own; streaming and random score nothing, the context's
# queries measure them), except on a CPU for the methods whose attention the full repeat pass
# is bound by (`banded_on_cpu`: the -fast variants, and am-h2o and kvzip, the methods for
# sessions compacted again and again, measured online with it): the banded pass.
def default_query_source(name: str, device: torch.device) -> str:
    """The reference queries method `name` takes on `device` when a request names none."""
    chosen = method(name)
    if chosen.banded_on_cpu and device.type == "cpu":
        return "repeat-banded"
    return chosen.query_source


REPEAT_INSTRUCTION = "\n\nRepeat the text above exactly, word for word.\n\n"
STUDY_INSTRUCTION = "\n\nWrite one question about the text above, then answer it.\nQuestion:"


# The default method, "auto": a measured choice, not a method of its own. KVzip's keys (each
# key's largest attention from the model repeating the context) with the slots shared over
# every head and layer by that score (budgets="global", as KVzip's paper and kvpress give them
# out), the repeat pass the method's own (banded on a CPU), keep the most in each setting
# measured on SmolLM2 but one (docs/compaction.md, "Which method"): compacted once, 2K tokens,
# 0.99 / 0.87 / 0.59 of the facts at 4x / 10x / 20x (`bench.compaction --methods auto`,
# medians of 5) against the best other method's 0.65 (H2O) / 0.73 / 0.63 (am-omp with measured
# budgets: 0.04 more at 20x, at several times the time); online (8K, 14 compactions at 4x)
# 0.78 against 0.72 for kvzip alone and 0.53 for am-highest-fast, the default before;
# RULER's needles at 4K (with the full repeat pass) 54.2 at 4x where am-highest-fast keeps
# 8.3 and the uncompressed cache 60.4. (Those are the benches' 64 exact recent tokens; at the
# server's keep_recent 0, once at 2K: 0.91 / 0.69 at 10x / 20x against am-omp's 0.77 / 0.69.)
AUTO = "auto"
AUTO_METHOD = "kvzip"
AUTO_BUDGETS = "global"


def resolve_auto(name: str, budgets: str | None, query_source: str | None) -> tuple[str, str]:
    """A request's (method, budgets), `auto` and an unset budgets resolved: `auto` is
    AUTO_METHOD with AUTO_BUDGETS unless budgets are asked for (or the queries come on-policy,
    layer by layer, where no budget over every layer can be had); any other method is uniform
    unless asked."""
    if name != AUTO:
        return name, budgets or "uniform"
    if budgets is None:
        budgets = "uniform" if query_source == "on-policy" else AUTO_BUDGETS
    return AUTO_METHOD, budgets
