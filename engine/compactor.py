"""Compact a KV-cache row with Attention Matching (or a baseline), end to end.

1. Reference queries, per layer (post-RoPE, every query head), from one or more sources:
   - context: the context's own queries (one causal prefill of it);
   - repeat: the queries of an instruction to repeat the context followed by the context
     again, run against the row's real cache (nothing is committed);
   - self-study: the model writes a short question-and-answer about the context on a copy of
     the row; the queries of what it wrote are captured.
   - on-policy: the repeat queries again, but layer l's are taken with layers < l already
     compacted, so each layer is fitted to the inputs it will really see afterwards. One pass:
     the capture hook of layer l compacts layer l on a working copy of the row before that
     layer attends (its dropped slots masked with a -inf bias), so the layers above run on
     the compacted layers below.
   Queries that come after the context are the useful reference: they are what later requests
   look like, and a bias fitted to the context's own queries does not carry over to them.
2. Per layer and KV head, `engine.compaction.compact_head` on the region [0, T - keep_recent)
   (which may already hold compacted slots with biases: compaction composes).
3. `KVCache.replace_prefix`: t slots stand for the region; the logical length is unchanged, so
   later tokens keep their RoPE positions.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from engine.compaction import METHODS, HeadInputs, compact_head, relative_output_error
from engine.kv_cache import KVCache
from models.transformer import Transformer, capture_queries

QUERY_SOURCES = ("context", "repeat", "self-study", "repeat+self-study", "on-policy")
REPEAT_INSTRUCTION = "\n\nRepeat the text above exactly, word for word.\n\n"
STUDY_INSTRUCTION = "\n\nWrite one question about the text above, then answer it.\nQuestion:"


@dataclass(slots=True)
class CompactionReport:
    method: str
    query_source: str
    tokens_before: int  # physical slots before
    tokens_after: int
    logical_length: int
    region: int  # slots that were compacted
    target: int  # slots that replaced them
    reference_queries: int
    output_error: float  # mean relative attention-output error over layers and heads
    seconds: dict[str, float] = field(default_factory=dict)  # queries, keys, beta, values

    @property
    def ratio(self) -> float:
        return self.tokens_before / max(1, self.tokens_after)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


def copy_row(cache: KVCache, row: int) -> KVCache:
    """A batch-1 cache holding a copy of one row's committed slots."""
    n = cache.lengths[row]
    keys = [k[row : row + 1, :, : max(n, 1)].clone() for k in cache.keys]
    values = [v[row : row + 1, :, : max(n, 1)].clone() for v in cache.values]
    biases = (
        None
        if cache.biases is None
        else [b[row : row + 1, :, : max(n, 1)].clone() for b in cache.biases]
    )
    return KVCache(keys, values, [n], [cache.logical[row]], biases)


def _stack_layers(captured: list[list[Tensor]]) -> list[Tensor]:
    """Per layer: [H, n, D] queries from the forwards captured (batch row 0)."""
    return [torch.cat([q[0] for q in forwards], dim=1) for forwards in captured]


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def context_queries(model: Transformer, context_ids: list[int]) -> list[Tensor]:
    ids = torch.tensor([context_ids], device=model.device)
    with capture_queries(model) as captured:
        model(ids)
    return _stack_layers(captured)


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def queries_after(model: Transformer, cache: KVCache, row: int, ids: list[int]) -> list[Tensor]:
    """Queries of `ids` read as a continuation of the row (attending to its real cache);
    nothing is committed."""
    tokens = torch.tensor([ids], device=model.device)
    cache.ensure_capacity(cache.lengths[row] + len(ids))  # before the view: views share buffers
    view = cache.rows(row, row + 1)
    with capture_queries(model) as captured:
        model(tokens, cache=view, commit=False)
    return _stack_layers(captured)


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def self_study_queries(
    model: Transformer, tokenizer: Any, cache: KVCache, row: int, new_tokens: int = 48
) -> list[Tensor]:
    """The model asks and answers a question about the context (greedy, on a copy of the
    row); the queries of the instruction and of everything it wrote are captured."""
    work = cache.extract_row(row)
    work.ensure_capacity(work.lengths[0] + new_tokens + 64)
    prompt = tokenizer.encode(STUDY_INSTRUCTION, add_special_tokens=False)
    eos = set(model.config.eos_token_ids)
    with capture_queries(model) as captured:
        hidden = model(torch.tensor([prompt], device=model.device), cache=work)
        token = int(model.logits(hidden[:, -1]).argmax(-1))
        for _ in range(new_tokens):
            if token in eos:
                break
            hidden = model(torch.tensor([[token]], device=model.device), cache=work)
            token = int(model.logits(hidden[:, -1]).argmax(-1))
    return _stack_layers(captured)


def reference_queries(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    source: str,
) -> list[Tensor]:
    """Per layer [H, n, D]: the queries of `source`, one of QUERY_SOURCES bar "on-policy" (which
    only exists during a compaction); `compact_row` checks the name."""
    parts: list[list[Tensor]] = []
    if source == "context":
        parts.append(context_queries(model, context_ids))
    if "repeat" in source:
        instruction = tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False)
        parts.append(queries_after(model, cache, row, instruction + context_ids))
    if "self-study" in source:
        parts.append(self_study_queries(model, tokenizer, cache, row))
    return [torch.cat([p[layer] for p in parts], dim=1) for layer in range(len(parts[0]))]


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def compact_row(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    target: int,
    method: str = "am-highest",
    query_source: str = "repeat",
    keep_recent: int = 0,
    seed: int = 0,
    max_queries: int = 2048,
) -> CompactionReport:
    """Replace the row's first `length - keep_recent` slots by `target` slots per KV head.

    `context_ids` is the token history the row holds (queries are built from it). Each KV head
    fits at most `max_queries` reference queries (a seeded random subset of its group's): the
    fits cost O(queries x tokens), and a few thousand queries already pin t << T slots."""
    if method not in METHODS:
        raise ValueError(f"unknown compaction method {method!r}; known: {', '.join(METHODS)}")
    if query_source not in QUERY_SOURCES:
        raise ValueError(
            f"unknown query source {query_source!r}; known: {', '.join(QUERY_SOURCES)}"
        )
    length = cache.lengths[row]
    region = length - keep_recent
    if keep_recent < 0 or region < 1:
        raise ValueError(f"keep_recent={keep_recent} leaves nothing of {length} slots to compact")
    if not 1 <= target <= region:
        raise ValueError(f"target {target} must be between 1 and the {region} slots compacted")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    fit = _LayerFit(model.config, cache, row, region, target, method, seed, max_queries, seconds)
    if query_source == "on-policy":
        n_queries = _on_policy(model, tokenizer, cache, row, context_ids, fit)
        fitting = sum(seconds.get(k, 0.0) for k in ("keys", "beta", "values"))
        seconds["queries"] = time.perf_counter() - started - fitting  # the forward's share
    else:
        queries = reference_queries(model, tokenizer, cache, row, context_ids, query_source)
        seconds["queries"] = time.perf_counter() - started
        for layer in range(model.config.num_layers):
            fit(layer, queries[layer])
        n_queries = int(queries[0].shape[1])
    cache.replace_prefix(row, region, fit.keys, fit.values, fit.biases)
    seconds = {k: round(v, 4) for k, v in seconds.items()}
    seconds["total"] = round(time.perf_counter() - started, 4)
    return CompactionReport(
        method=method,
        query_source=query_source,
        tokens_before=length,
        tokens_after=cache.lengths[row],
        logical_length=cache.logical[row],
        region=region,
        target=target,
        reference_queries=n_queries,
        output_error=round(sum(fit.errors) / len(fit.errors), 5),
        seconds=seconds,
    )


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
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    biases: list[Tensor] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, layer: int, queries: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """queries [H, n, D] -> this layer's (keys [Hkv, t, D], values, beta [Hkv, t])."""
        cfg, region = self.cfg, self.region
        group = cfg.num_heads // cfg.num_kv_heads
        keys, values, bias = self.cache.read(self.row, layer)  # [Hkv, T, D], [Hkv, T]
        q = queries.cpu()
        layer_k, layer_v, layer_b = [], [], []
        for g in range(cfg.num_kv_heads):
            pooled = q[g * group : (g + 1) * group].reshape(-1, cfg.head_dim)
            if pooled.shape[0] > self.max_queries:
                pick = torch.randperm(pooled.shape[0], generator=self.generator)
                pooled = pooled[pick[: self.max_queries].sort().values]
            h = HeadInputs(
                keys=keys[g, :region].float().cpu(),
                values=values[g, :region].float().cpu(),
                queries=pooled,
                scale=cfg.head_dim**-0.5,
                bias=None if bias is None else bias[g, :region].float().cpu(),
            )
            r = compact_head(h, self.target, self.method, self.generator, self.seconds)
            self.errors.append(relative_output_error(h, r))
            layer_k.append(r.keys)
            layer_v.append(r.values)
            layer_b.append(r.bias)
        device = keys.device
        out = (
            torch.stack(layer_k).to(device),
            torch.stack(layer_v).to(device),
            torch.stack(layer_b).to(device),
        )
        self.keys.append(out[0])
        self.values.append(out[1])
        self.biases.append(out[2])
        return out


class _OnPolicySink(list):
    """Stands in for a layer's query-capture list: when the layer hands over its queries
    (before it attends), compact it and splice the result into the working copy, so this
    layer's attention, and every layer above, runs on the compacted cache."""

    def __init__(self, layer: int, fit: _LayerFit, work: KVCache):
        super().__init__()
        self.layer, self.fit, self.work = layer, fit, work

    def append(self, q: Tensor) -> None:  # q [1, H, n, D]
        keys, values, beta = self.fit(self.layer, q[0])
        t, region = keys.shape[1], self.fit.region
        k_buf, v_buf = self.work.keys[self.layer], self.work.values[self.layer]
        b_buf = self.work.biases[self.layer]  # type: ignore[index]
        k_buf[0, :, :t] = keys.to(k_buf.dtype)
        v_buf[0, :, :t] = values.to(v_buf.dtype)
        b_buf[0, :, :t] = beta.to(b_buf.dtype)
        # The slots the segment replaces stay in place (so every layer keeps one length) but
        # can no longer be attended to.
        k_buf[0, :, t:region] = 0
        v_buf[0, :, t:region] = 0
        b_buf[0, :, t:region] = float("-inf")
        super().append(q)


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def _on_policy(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    fit: _LayerFit,
) -> int:
    """Compact every layer in one pass of the repeat sequence over a working copy of the row;
    returns the number of reference queries per layer."""
    work = copy_row(cache, row)
    if work.biases is None:
        work.biases = [torch.zeros_like(k[:, :, :, 0], dtype=torch.float32) for k in work.keys]
    ids = tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False) + context_ids
    work.ensure_capacity(work.lengths[0] + len(ids))
    sinks = [_OnPolicySink(i, fit, work) for i in range(model.config.num_layers)]
    for block, sink in zip(model.layers, sinks, strict=True):
        block.attn.captured = sink
    model._capturing = True
    try:
        model(torch.tensor([ids], device=model.device), cache=work, commit=False)
    finally:
        model._capturing = False
        for block in model.layers:
            block.attn.captured = None
    return len(ids)
