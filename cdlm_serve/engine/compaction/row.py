"""Compact a KV-cache row with Attention Matching (or a baseline), end to end.

1. Reference queries, per layer (post-RoPE, every query head), from one or more sources:
   - context: the context's own queries (one causal prefill of it);
   - repeat: the queries of an instruction to repeat the context followed by the context
     again, run against the row's real cache (nothing is committed);
   - repeat-banded: the same pass with each repeated token attending only near its own
     original (`models.attention.Band`: at least REPEAT_WINDOW slots either side, the first
     slots, the instruction, at least its last REPEAT_WINDOW repeated tokens): a repeat mostly
     reads the token it copies, and the fits still score every key exactly for these queries.
     O(T x window) attention instead of O(T^2). The -fast variants' default on a CPU. On a
     row compacted before (its first slots stand for more tokens than they are) the repeated
     tokens after its segment line up with their slots, and every one sees the segment
     whole (`repeat_band`; where the segment is not known, the full pass);
   - self-study: the model writes a short question-and-answer about the context on a copy of
     the row; the queries of what it wrote are captured.
   - on-policy: the repeat queries again, but layer l's are taken with layers < l already
     compacted, so each layer is fitted to the inputs it will really see afterwards: the
     repeat sequence runs one layer at a time over a working copy of the row, and layer l is
     compacted (and spliced into the copy, its dropped slots masked with a -inf bias) between
     its queries and its attention.
   Queries that come after the context are the useful reference: they are what later requests
   look like, and a bias fitted to the context's own queries does not carry over to them.
   The am-highest variants' keys are ranked by the context's own queries as well
   (KEY_QUERIES): the causal attention a sample of them paid at prefill, accumulated (the
   sampled tokens run again over the row's cache: `context_key_queries`), while beta and the
   values are fitted on the reference queries.
2. Per layer and KV head, `engine.compaction.attention_matching.compact_head` on the region
   [0, T - keep_recent) (which may already hold compacted slots with biases: compaction
   composes).
3. `KVCache.replace_prefix`: t slots stand for the region; the logical length is unchanged, so
   later tokens keep their RoPE positions.

Bounded pieces of work. Everything that runs the model goes through `on_engine(fn)`, one piece
at a time: the long forwards run one query chunk of one layer's attention per piece
(`Transformer.forward_stages`), the self-study generation one token per piece. The server passes
a function that runs each piece on the model's engine thread between two decode steps and runs
everything else (the fits, which are most of the time) on a compaction thread of its own, so a
compaction holds the engine for one such piece at a time (`CompactionReport.engine_seconds_max`).
Layers are fitted as their queries arrive, so only one layer's queries are held at once. OMP's key
selection has a wall-time budget (`OmpBudget`) past which it continues as its fast variant,
then takes the remaining keys by attention; the report says so.

(One algorithm end to end, ~490 lines: `compact_row`, its per-layer fit and the on-policy pass;
what a request may ask is `engine/compaction/options.py`, the queries `compaction_queries.py`.)
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.engine.compaction import baselines
from cdlm_serve.engine.compaction import budgets as compaction_budgets
from cdlm_serve.engine.compaction.attention_matching import (
    HeadInputs,
    HeadResult,
    OmpBudget,
    sampled_output_error,
)
from cdlm_serve.engine.compaction.head import compact_head
from cdlm_serve.engine.compaction.kv_quant import QuantizedSegment, quantize_prefix
from cdlm_serve.engine.compaction.methods import CompactionMethod, registry
from cdlm_serve.engine.compaction.options import (
    REPEAT_INSTRUCTION,
)
from cdlm_serve.engine.compaction.queries import (
    _Engine,
    _stages,
    _urgency,
    context_key_queries,
    copy_row,
    fitted_layers,
    reference_queries,
)
from cdlm_serve.engine.compaction.spec import CompactionRuntime, CompactionSpec
from cdlm_serve.engine.model_work import OnEngine, inline
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.transformer import Transformer


@dataclass(slots=True)
class CompactionReport:
    method: str
    query_source: str
    key_queries: str  # whose attention ranked the keys: "reference" or "context" (KEY_QUERIES)
    tokens_before: int  # physical slots before
    tokens_after: int
    logical_length: int
    region: int  # slots that were compacted
    target: int  # slots that replaced them, per KV head (on average, non-uniform budgets)
    budgets: str  # "uniform", "attention" (per head by its attention), "measured" (schedule)
    segment_slots: int  # the segment's length in the row: its longest head's slots
    head_slots: int  # slots the heads hold, all layers and heads together (without padding)
    reference_queries: int
    # Tokens of the context whose own queries ranked the am-highest keys (key_queries "context";
    # 0: the reference's did): a re-read sample, or its whole logical history where it had to be.
    context_tokens: int
    # Mean relative attention-output error over layers and heads, each on ERROR_QUERIES of its
    # reference queries (`sampled_output_error`).
    output_error: float
    seconds: dict[str, float] = field(default_factory=dict)  # queries, keys, beta, values
    # Pieces of model work and the longest of them (what the engine thread was held for).
    engine_jobs: int = 0
    engine_seconds_max: float = 0.0
    # Set when OMP ran out of its time budget: what it did instead, from which layer on.
    fallback: str | None = None
    quantized: str | None = (
        None  # "int8": the compacted segment is int8 codes (engine.compaction.kv_quant)
    )
    codes: QuantizedSegment | None = field(default=None, repr=False)  # those codes (not JSON)

    @property
    def ratio(self) -> float:
        return self.tokens_before / max(1, self.tokens_after)

    def to_dict(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "codes"}
        return {**body, "seconds": dict(self.seconds), "ratio": round(self.ratio, 3)}


INLINE = CompactionRuntime()  # a compaction run right here, as benches and tests do


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def compact_row(
    model: Transformer,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    spec: CompactionSpec,
    runtime: CompactionRuntime = INLINE,
) -> CompactionReport:
    """Replace the row's first `length - spec.keep_recent` slots by `spec.target(length)`
    slots per KV head, as `spec` asks (`engine.compaction.spec`; SpecError if it cannot).

    `context_ids` is the token history the row holds (queries are built from it). Each KV head
    fits at most `runtime.max_queries` reference queries (a seeded random subset of its
    group's): the fits cost O(queries x tokens), and a few thousand queries already pin t << T
    slots. `runtime.on_engine` runs the pieces that use the model (see the module's doc),
    `on_fit` each layer's fit (the server's core share: on every core when nothing else is
    busy); `omp_budget` bounds OMP's key selection, in seconds for the whole compaction.
    `reference`: the source's per-layer queries, captured before on this very row (a benchmark
    compacting one row many ways); not for on-policy, whose queries depend on the fit.
    `urgent()` says whether the model's requests wait for the pieces of model work (then they
    are about a decode step each, else larger: `models.layers.Pace`); without it, they are
    small whenever `on_engine` is not `inline`. `spec.quantize="int8"` stores the compacted
    segment as int8 codes (`engine.compaction.kv_quant`; the report carries them, `codes`).
    `spec.budgets="attention"` gives the KV heads of all layers their shares of the same total
    by measured attention (`engine.compaction.budgets`; not with on-policy queries, which are
    fitted layer by layer); `budgets="measured"` splits it by the model's measured
    `runtime.schedule` (per layer, per KV head, its share: `budgets.load_schedule`). The
    segment is then as long as its longest head, the others' extra slots masked; `longest`
    caps that head (an auto-compaction's, `AutoCompact.longest`, so that its row shrinks).
    `spec.key_queries`: whose attention ranks the am-highest variants' keys (KEY_QUERIES):
    "context" takes `context_key_queries`, max_queries / group of them (each KV head ranks by
    its group's queries at those positions). `runtime.segment_slots`: on a row compacted
    before, its last compaction's (the report's); lets the context ranking re-read the tokens
    after the segment instead of a causal pass over the whole history."""
    method, quantize, budgets = spec.method, spec.quantize, spec.budgets
    query_source, key_queries = spec.source_on(model.device), spec.ranking()
    length = cache.lengths[row]
    target, region = spec.target(length), spec.region(length)
    tokenizer, seed, max_queries = runtime.tokenizer, runtime.seed, runtime.max_queries
    on_engine, on_fit, urgent = runtime.on_engine, runtime.on_fit, runtime.urgent
    omp_budget, reference, schedule = runtime.omp_budget, runtime.reference, runtime.schedule
    segment_slots, longest = runtime.segment_slots, runtime.longest
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    budget = None if omp_budget is None else OmpBudget.starting_now(omp_budget)
    fit = _LayerFit(
        model.config,
        cache,
        row,
        region,
        target,
        method,
        seed,
        max_queries,
        seconds,
        budget,
        on_fit,
    )
    if registry.method(method).needs_future:
        fit.rope = _expected_attention_rope(model, len(context_ids), cache.logical[row])
    if budgets == "measured":
        if schedule is None:
            raise ValueError("this model has no measured budget schedule (budgets)")
        fit.head_targets = compaction_budgets.from_schedule(schedule, target, region, longest)
    engine = _Engine(on_engine, urgent or _urgency(on_engine))
    # Per layer, the context queries and their positions that rank the keys, where any do.
    ranking: Iterator[tuple[Tensor, Tensor] | None] = itertools.repeat(None)
    own = key_queries == "context" and query_source == "context"  # by the fitted queries
    # A sample of the context's tokens: each KV head pools its group's queries at them.
    count = max(1, max_queries // (model.config.num_heads // model.config.num_kv_heads))
    if key_queries == "context" and not own:
        ranking = context_key_queries(
            model, cache, row, context_ids, count, seed + 1, engine, segment_slots
        )
    if query_source == "on-policy":
        n_queries = _on_policy(model, tokenizer, cache, row, context_ids, fit, engine, ranking)
    else:
        queries: Iterable[Tensor] | None = reference
        if (
            queries is None
            and registry.method(method).scoring == "none"
            and query_source == "context"
        ):
            # Nothing scores these keys: the queries only measure the output error, which a
            # re-read sample measures as well as a pass over the whole (logical) context.
            sample = context_key_queries(
                model, cache, row, context_ids, count, seed, engine, segment_slots
            )
            queries = (q for q, _ in sample)
        if queries is None:
            queries = reference_queries(
                model, tokenizer, cache, row, context_ids, query_source, engine, segment_slots
            )
        if budgets == "attention":
            every = list(queries)  # every layer's, before any fit
            fit.head_targets = on_fit(
                lambda: compaction_budgets.allocate(
                    model.config, cache, row, region, target, every, fit.generator, longest
                )
            )
            queries = every
        scored = 0
        if budgets == "global":
            # Each layer scored as its queries arrive and let go of but for a sample (the
            # output error's): the selection needs only the scores. (At 8K tokens every
            # layer's repeat queries held at once are ~0.6 GB in fp32.)
            sampled = []
            for layer, q in enumerate(queries):
                sampled.append(on_fit(functools.partial(fit.score_layer, layer, q)))
                scored = int(q.shape[1])
            on_fit(lambda: fit.share_slots(longest))
            queries = sampled
        n_queries = max(scored, _fit_layers(fit, queries, ranking, own))
    fitting = sum(seconds.get(k, 0.0) for k in ("keys", "beta", "values"))
    seconds["queries"] = time.perf_counter() - started - fitting
    cache.replace_prefix(row, region, fit.keys, fit.values, fit.biases)
    if cache.window is not None:
        cache.window.trim(cache.logical)  # a repeat pass grew the window layers' ring
    codes = None
    if quantize == "int8":  # the codes stand for the segment from now on, here too
        codes = on_fit(lambda: quantize_prefix(cache, fit.slots, row))
    seconds = {k: round(v, 4) for k, v in seconds.items()}
    seconds["total"] = round(time.perf_counter() - started, 4)
    return CompactionReport(
        method=method,
        query_source=query_source,
        key_queries=key_queries,
        tokens_before=length,
        tokens_after=cache.lengths[row],
        logical_length=cache.logical[row],
        region=region,
        target=target,
        budgets=budgets,
        segment_slots=fit.slots,
        head_slots=fit.real_slots,
        reference_queries=n_queries,
        context_tokens=fit.context_tokens,
        output_error=round(sum(fit.errors) / len(fit.errors), 5),
        seconds=seconds,
        engine_jobs=engine.jobs,
        engine_seconds_max=round(engine.longest, 4),
        fallback=None if budget is None else budget.describe(),
        quantized=quantize,
        codes=codes,
    )


def _fit_layers(
    fit: _LayerFit,
    queries: Iterable[Tensor],
    ranking: Iterator[tuple[Tensor, Tensor] | None],
    own: bool,
) -> int:
    """Fit each layer as its reference queries [H, n, D] arrive, its keys ranked by `ranking`'s
    context queries (or, `own`, by these very queries: they are the context's). Returns n."""
    n_queries = 0
    for layer, q in enumerate(queries):
        fit(layer, q, (q, torch.arange(q.shape[1])) if own else next(ranking))
        n_queries = int(q.shape[1])
    return n_queries


@dataclass(eq=False)
class _LayerFit:
    """Compacts one layer of a row (every KV head) from its reference queries, and collects
    the segments for `KVCache.replace_prefix`."""

    cfg: Any
    cache: KVCache
    row: int
    region: int
    target: int
    method: str
    seed: int
    max_queries: int
    seconds: dict[str, float]
    budget: OmpBudget | None = None
    on_fit: OnEngine[Any] = inline
    # Expected Attention's RoPE tables: (cos, sin) of the context queries' positions [n, D],
    # then of the future positions [F, D].
    rope: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    # Non-uniform budgets: per layer, per KV head, its slots (else `target` for all).
    head_targets: list[list[int]] | None = None
    # budgets="global": each (layer, KV head)'s key scores, computed to share the slots and
    # kept for its selection.
    head_scores: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    real_slots: int = 0  # what the heads hold, summed
    context_tokens: int = 0  # how many of the context's tokens' queries ranked the keys
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    biases: list[Tensor] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)
    traits: CompactionMethod = field(init=False)  # the method's (registry)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        # The context queries' subsample draws from its own stream: the reference queries'
        # subsample stays what it is without them.
        self.key_generator = torch.Generator().manual_seed(self.seed + 1)
        self.traits = registry.method(self.method)

    @property
    def slots(self) -> int:
        """The segment's length: the longest head's budget."""
        if self.head_targets is None:
            return self.target
        return max(max(heads) for heads in self.head_targets)

    def __call__(
        self, layer: int, queries: Tensor, ranking: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """queries [H, n, D] -> this layer's (keys [Hkv, t, D], values, beta [Hkv, t]), fitted
        through `on_fit`; `ranking`: the context's own queries [H, n', D] and their positions
        [n'], where they rank the keys (key_queries="context")."""

        def work() -> tuple[Tensor, Tensor, Tensor]:
            with torch.no_grad():  # grad mode is per thread: say it where the work runs
                return self._fit(layer, queries, ranking)

        segment: tuple[Tensor, Tensor, Tensor] = self.on_fit(work)
        return segment

    def _fit(
        self, layer: int, queries: Tensor, ranking: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        layer_k, layer_v, layer_b = [], [], []
        if self.budget is not None:
            self.budget.layer = layer
        for g, h in enumerate(self._heads(layer, queries, ranking)):
            h.scores = self.head_scores.pop((layer, g), None)
            t = self.target if self.head_targets is None else self.head_targets[layer][g]
            r = compact_head(h, t, self.method, self.generator, self.seconds, self.budget)
            self.errors.append(sampled_output_error(h, r))
            self.real_slots += t
            keys_g, values_g, bias_g = _padded(r, self.slots)
            layer_k.append(keys_g)
            layer_v.append(values_g)
            layer_b.append(bias_g)
        device = self.cache.read(self.row, layer)[0].device
        out = (
            torch.stack(layer_k).to(device),
            torch.stack(layer_v).to(device),
            torch.stack(layer_b).to(device),
        )
        self.keys.append(out[0])
        self.values.append(out[1])
        self.biases.append(out[2])
        return out

    def score_layer(self, layer: int, queries: Tensor) -> Tensor:
        """budgets="global": this layer's KV heads' key scores (`CompactionMethod.scores`, from
        its reference queries [H, n, D]), kept for `share_slots` and the selection; returns a
        seeded sample of the queries [H, n', D], as many a head as the fits' own sample."""
        started = time.perf_counter()
        with torch.no_grad():  # grad mode is per thread: say it where the work runs
            for g, h in enumerate(self._heads(layer, queries, None)):
                scores = self.traits.scores(h)
                assert scores is not None, self.method  # the spec refuses such a method
                self.head_scores[(layer, g)] = scores
        self.seconds["keys"] = self.seconds.get("keys", 0.0) + time.perf_counter() - started
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        n = queries.shape[1]
        pick = torch.randperm(n, generator=self.generator)[: max(1, self.max_queries // group)]
        return queries[:, pick.sort().values].clone()

    def share_slots(self, longest: int | None) -> None:
        """budgets="global": the layers x heads x target slots given to the highest key scores
        over every head and layer at once, as KVzip's paper and kvpress evict
        (`budgets.global_counts`)."""
        ranked = [
            self.head_scores[key].sort(descending=True).values for key in sorted(self.head_scores)
        ]
        self.head_targets = compaction_budgets.global_counts(
            ranked, self.target, self.region, self.cfg.num_kv_heads, longest
        )

    def _heads(
        self, layer: int, queries: Tensor, ranking: tuple[Tensor, Tensor] | None
    ) -> Iterator[HeadInputs]:
        """Each KV head's inputs of this layer, from its queries [H, n, D]."""
        cfg, region = self.cfg, self.region
        group = cfg.num_heads // cfg.num_kv_heads
        keys, values, bias = self.cache.read(self.row, layer)  # [Hkv, T, D], [Hkv, T]
        q = queries.cpu()
        if ranking is not None:
            self.context_tokens = int(ranking[1].numel())
        future = None
        if self.rope is not None:
            future = baselines.future_query_statistics(q, *self.rope)  # [H, D], [H, D, D]
        for g in range(cfg.num_kv_heads):
            every = q[g * group : (g + 1) * group].reshape(-1, cfg.head_dim)
            pooled = every
            if pooled.shape[0] > self.max_queries:
                pick = torch.randperm(pooled.shape[0], generator=self.generator)
                pooled = pooled[pick[: self.max_queries].sort().values]
            h = HeadInputs(
                keys=keys[g, :region].float().cpu(),
                values=values[g, :region].float().cpu(),
                queries=pooled,
                scale=cfg.scale,
                bias=None if bias is None else bias[g, :region].float().cpu(),
            )
            if self.traits.reads_every_query:  # its max reads every query, the whole row
                h.every_query = every
                self._add_tail(h, keys[g], bias, g)
            if self.traits.scoring == "context":
                self._add_context(h, q[g * group : (g + 1) * group], keys[g], bias, g)
            elif ranking is not None:
                own = ranking[0][g * group : (g + 1) * group].cpu()  # [G, n', D]
                sample, positions = self._sample(own, ranking[1])
                self._add_context(h, sample[None], keys[g], bias, g, positions)
                h.context_keys = True
            if future is not None:
                heads = slice(g * group, (g + 1) * group)
                h.future = (future[0][heads], future[1][heads])
            yield h

    def _sample(self, group_queries: Tensor, at: Tensor) -> tuple[Tensor, Tensor]:
        """The group's context queries [G, n, D] at positions `at` [n] pooled, at most
        `max_queries` of them (a seeded random subset): [n', D] and their positions [n']."""
        g, n, d = group_queries.shape
        pooled = group_queries.reshape(g * n, d)
        positions = at.cpu().repeat(g)
        if pooled.shape[0] > self.max_queries:
            pick = torch.randperm(pooled.shape[0], generator=self.key_generator)
            pick = pick[: self.max_queries].sort().values
            pooled, positions = pooled[pick], positions[pick]
        return pooled, positions

    def _add_context(
        self,
        h: HeadInputs,
        group_queries: Tensor,
        keys: Tensor,
        bias: Tensor | None,
        g: int,
        query_positions: Tensor | None = None,
    ) -> None:
        """What the scores from the context's queries read: those queries [G, n, D] at
        positions 0..n-1 (or `query_positions` [n]), and every slot's position. A row never
        compacted holds slot i at position i; on one compacted before (its first slots stand
        for more tokens than they are), slot i is taken to be at i + logical - physical, the
        compacted slots counting as the oldest visible ones: an approximation only those rows
        need."""
        length = keys.shape[0]
        positions = torch.arange(length) + self.cache.logical[self.row] - length
        h.head_queries = group_queries
        if query_positions is None:
            query_positions = torch.arange(group_queries.shape[1])
        h.query_positions = query_positions
        h.key_positions = positions[: self.region]
        self._add_tail(h, keys, bias, g)
        h.tail_positions = positions[self.region :]

    def _add_tail(self, h: HeadInputs, keys: Tensor, bias: Tensor | None, g: int) -> None:
        """The row's slots after the region, which every query attends to as well: their
        keys [R, D] (of this KV head's `keys` [T, D]) and bias [R]."""
        h.tail_keys = keys[self.region :].float().cpu()
        tail = keys.shape[0] - self.region
        h.tail_bias = torch.zeros(tail) if bias is None else bias[g, self.region :].float().cpu()


def _padded(r: HeadResult, slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """A head's compacted keys, values [t, D] and beta [t], padded to `slots` with slots no
    query can see (zero keys and values, a -inf bias)."""
    extra = slots - r.keys.shape[0]
    if extra == 0:
        return r.keys, r.values, r.bias
    pad = r.keys.new_zeros(extra, r.keys.shape[1])
    hidden = torch.full((extra,), float("-inf"), dtype=r.bias.dtype)
    return torch.cat([r.keys, pad]), torch.cat([r.values, pad]), torch.cat([r.bias, hidden])


def _expected_attention_rope(
    model: Transformer, n_queries: int, logical: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 cos/sin of the context queries' positions [0, n) and of the positions the next
    EXPECTED_FUTURE tokens will take, from the row's logical length on."""
    cos, sin = model.rope_fp32(0, n_queries)
    future_cos, future_sin = model.rope_fp32(logical, baselines.EXPECTED_FUTURE)
    return cos, sin, future_cos, future_sin


def _splice(work: KVCache, layer: int, segment: tuple[Tensor, Tensor, Tensor], region: int) -> None:
    """Put a layer's compacted segment into the working copy: this layer's attention, and every
    layer above, then runs on the compacted cache. The slots the segment replaces stay in
    place (so every layer keeps one length) but can no longer be attended to."""
    keys, values, beta = segment
    t = keys.shape[1]
    k_buf, v_buf = work.keys[layer], work.values[layer]
    b_buf = work.biases[layer]  # type: ignore[index]
    k_buf[0, :, :t] = keys.to(k_buf.dtype)
    v_buf[0, :, :t] = values.to(v_buf.dtype)
    b_buf[0, :, :t] = beta.to(b_buf.dtype)
    k_buf[0, :, t:region] = 0
    v_buf[0, :, t:region] = 0
    b_buf[0, :, t:region] = float("-inf")


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def _on_policy(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    fit: _LayerFit,
    engine: _Engine,
    ranking: Iterator[tuple[Tensor, Tensor] | None],
) -> int:
    """Compact every layer in one staged pass of the repeat sequence over a working copy of the
    row: layer l is fitted from its queries (its keys ranked by `ranking`'s, the context's
    own, where it yields them) and spliced in before it attends. Returns the number of
    reference queries per layer."""
    work = copy_row(cache, row)
    if work.biases is None:
        work.biases = [torch.zeros_like(k[:, :, :, 0], dtype=torch.float32) for k in work.keys]
    ids = tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False) + context_ids
    stages = _stages(model, ids, engine.pace, work, 0)
    for layer, q in enumerate(engine.layers(stages, fitted_layers(model))):
        _splice(work, layer, fit(layer, q, next(ranking)), fit.region)
    return len(ids)
