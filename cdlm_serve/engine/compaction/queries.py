"""A compaction's queries: the reference queries its fits are made on (`reference_queries`:
context, repeat, repeat-banded, self-study) and the context's own that rank the am-highest
variants' keys (`context_key_queries`), each produced one layer at a time by a staged forward
(`Transformer.forward_stages`) advanced one bounded piece of model work at a time through
`on_engine` (the server: the model's engine thread, between decode steps). See
`engine/compaction/row.py` for how they are used."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from cdlm_serve.engine.compaction import options as compaction_options
from cdlm_serve.engine.compaction.options import (
    REPEAT_INSTRUCTION,
    REPEAT_ROWS,
    REPEAT_WINDOW,
    STUDY_INSTRUCTION,
)
from cdlm_serve.engine.model_work import OnEngine, inline
from cdlm_serve.models.attention import Band
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.layers import Pace
from cdlm_serve.models.transformer import Transformer, new_capture

T = TypeVar("T")
# A staged forward (`Transformer.forward_stages`): a layer's queries, None between pieces.
Stages = Generator[Tensor | None, None, Tensor]


class _Done:
    """What `next` gives back once a staged forward has run out."""


_DONE = _Done()


def copy_row(cache: KVCache, row: int) -> KVCache:
    """A batch-1 cache holding a copy of one row's committed slots."""
    return cache.extract_row(row)


@dataclass(eq=False)
class _Engine:
    """`on_engine` with a stopwatch: counts the pieces and keeps the longest."""

    on_engine: OnEngine[Any]
    # Whether the model's requests wait for these pieces (then each is about a decode step).
    urgent: Callable[[], bool] = lambda: False
    jobs: int = 0
    longest: float = 0.0

    @property
    def pace(self) -> Pace:
        return Pace(self.urgent)

    def __call__(self, fn: Callable[[], T]) -> T:
        def timed() -> T:
            started = time.perf_counter()
            try:
                with torch.no_grad():  # grad mode is per thread: say it where the work runs
                    return fn()
            finally:
                self.longest = max(self.longest, time.perf_counter() - started)

        self.jobs += 1
        result: T = self.on_engine(timed)
        return result

    def layers(self, stages: Stages, layers: list[int]) -> Iterator[Tensor]:
        """Advance a staged forward one piece at a time (`Transformer.forward_stages`); its
        queries [H, n, D] fp32 (row 0) of the model layers `layers` (ascending), layer by
        layer. Once the last one's are out the forward stops: that layer's attention and MLP
        would only make hidden states nobody reads (1/layers of the pass)."""
        wanted = set(layers)
        for layer in range(max(layers) + 1):
            while (q := self(lambda: next(stages, _DONE))) is None:
                pass  # a pause inside a layer's attention
            if isinstance(q, _Done):
                return
            if layer in wanted:
                yield q[0].float()
        stages.close()


def fitted_layers(model: Transformer) -> list[int]:
    """The model layers a compaction fits, in order (the i-th is the cache's layer i): the
    global ones. A sliding-window layer's ring is bounded by its window already, and the
    Attention Matching paper compacts only the global layers of such models."""
    return model.config.global_layers


def _urgency(on_engine: OnEngine[Any]) -> Callable[[], bool]:
    """Without word from the caller: model work run right here (`inline`) delays nobody's
    decoding; work handed to an engine might."""
    urgent = on_engine is not inline
    return lambda: urgent


def _as_engine(on_engine: OnEngine[Any]) -> _Engine:
    """`on_engine` as an `_Engine` (kept where it is one: a compaction's own, counting)."""
    return on_engine if isinstance(on_engine, _Engine) else _Engine(on_engine, _urgency(on_engine))


def _stages(
    model: Transformer,
    ids: list[int],
    pace: Pace,
    cache: KVCache | None = None,
    row: int = 0,
    band: Band | None = None,
    reread: Tensor | None = None,
) -> Stages:
    """A staged forward of `ids`: alone (causal from position 0), or read as a continuation of
    a cache row (attending to its real slots, or those of the `band`, committing nothing), or
    (`reread`, their slots) as the row's own tokens read again. Nothing runs the model yet (the
    cache, locked by the caller and used by no one else, grows here, off the engine)."""
    tokens = torch.tensor([ids], device=model.device)
    if cache is None:
        return model.forward_stages(tokens, pace=pace)
    # Here, off the engine thread; exactly: these slots are scratch, dropped after the pass.
    cache.ensure_capacity(cache.lengths[row] + len(ids), exact=True)
    return model.forward_stages(
        tokens,
        cache=cache,
        rows=(row, row + 1),
        commit=False,
        pace=pace,
        band=band,
        reread=reread,
    )


def repeat_band(
    cache: KVCache, row: int, lead: int, segment: int | None = None, start: int = 0
) -> Band | None:
    """The band of a repeat pass over `row` after a `lead`-token instruction, repeating the
    context from its token `start` on: repeated token r is the one cached at slot r on a row
    never compacted. On a row compacted before, whose first `segment` slots (its last
    compaction's segment_slots) stand for the oldest tokens and whose later slots are its last
    tokens, a repeated token of those is lined up with its slot (r - logical + physical) and
    every repeated token sees the whole segment (as sinks); those the segment stands for see
    it, the instruction and the repeated tokens before them. None where the segment is not
    known (the full pass)."""
    length, logical = cache.lengths[row], cache.logical[row]
    band = Band(window=REPEAT_WINDOW, offset=start - lead, lead=lead, rows=REPEAT_ROWS)
    if logical == length:
        return band
    if segment is None or not 0 < segment < length:
        return None
    shift = logical - length  # how many more tokens than slots the segment stands for
    return replace(band, offset=start - lead - shift, sinks=max(band.sinks, segment))


def repeat_pieces(tokens: int) -> list[tuple[int, int]]:
    """The ranges [start, stop) of a `tokens`-long context that a repeat pass reads: all of it
    up to REPEAT_BUDGET tokens, else REPEAT_BUDGET / REPEAT_PIECE pieces spread evenly from its
    first token to its last (starts on REPEAT_ROWS boundaries, as the whole pass's blocks)."""
    budget, piece = compaction_options.REPEAT_BUDGET, compaction_options.REPEAT_PIECE
    if tokens <= budget:
        return [(0, tokens)]
    count = budget // piece
    last = tokens - piece  # the last piece's start: the newest tokens, whole
    spread = (round(i * last / (count - 1)) for i in range(count - 1))
    starts = {s // REPEAT_ROWS * REPEAT_ROWS for s in spread} | {last}
    return [(s, s + piece) for s in sorted(starts)]


@torch.no_grad()  # not inference_mode: the cache tensors it makes must stay writable
def self_study_queries(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    row: int,
    new_tokens: int = 48,
    on_engine: OnEngine[Any] = inline,
) -> list[Tensor]:
    """The model asks and answers a question about the context (greedy, on a copy of the
    row); per layer [H, n, D], the queries of the instruction and of everything it wrote. One
    piece of model work per forward."""
    work = copy_row(cache, row)
    work.ensure_capacity(work.lengths[0] + new_tokens + 64)
    prompt = tokenizer.encode(STUDY_INSTRUCTION, add_special_tokens=False)
    eos = set(model.config.eos_token_ids)
    captured = new_capture(model)

    def step(ids: list[int]) -> int:
        hidden = model(torch.tensor([ids], device=model.device), cache=work, capture=captured)
        return int(model.logits(hidden[:, -1]).argmax(-1))

    token = on_engine(lambda: step(prompt))
    for _ in range(new_tokens):
        if token in eos:
            break
        token = on_engine(functools.partial(step, [token]))
    fitted = fitted_layers(model)
    return [torch.cat([q[0] for q in captured[i]], dim=1) for i in fitted]


def reference_queries(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    source: str,
    on_engine: OnEngine[Any] = inline,
    segment: int | None = None,
) -> Iterator[Tensor]:
    """Per layer, in layer order, [H, n, D] fp32: the queries of `source`, one of
    QUERY_SOURCES bar "on-policy" (which only exists during a compaction). The long forwards
    advance in step, one layer each, so one layer's queries are held at a time. `segment`:
    on a row compacted before, its last compaction's segment_slots (`repeat_band`)."""
    engine = _as_engine(on_engine)
    streams: list[Iterator[Tensor]] = []
    layers = fitted_layers(model)
    if source == "context":
        streams.append(engine.layers(_stages(model, context_ids, engine.pace), layers))
    names = source.split("+")
    if "repeat" in names or "repeat-banded" in names:
        # Past REPEAT_BUDGET context tokens, pieces of it, each its own pass (they advance in
        # step: each layer's scratch slots are written and read within that layer's turn).
        instruction = tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False)
        lead = len(instruction)
        for i, (start, stop) in enumerate(repeat_pieces(len(context_ids))):
            band = None
            if "repeat-banded" in names:
                band = repeat_band(cache, row, lead, segment, start)
            ids = instruction + context_ids[start:stop]
            piece = engine.layers(_stages(model, ids, engine.pace, cache, row, band), layers)
            # The instruction's queries once, as in the whole pass.
            streams.append(piece if i == 0 else (q[:, lead:] for q in piece))
    if "self-study" in names:
        streams.append(iter(self_study_queries(model, tokenizer, cache, row, on_engine=engine)))
    for parts in zip(*streams, strict=True):
        yield torch.cat(parts, dim=1)


def context_key_queries(
    model: Transformer,
    cache: KVCache,
    row: int,
    context_ids: list[int],
    count: int,
    seed: int,
    on_engine: OnEngine[Any] = inline,
    segment: int | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Per layer, in layer order: the context's own queries [H, n, D] fp32 at n <= `count`
    seeded random positions, and those positions [n] (ascending), for ranking keys
    (KEY_QUERIES). The row's slots that are its own tokens are all of them on a row never
    compacted, and those after its first `segment` slots on a row compacted before (the
    segment_slots of its last compaction; None: not known). Those tokens are run again over
    the row's cache, each seeing the slots up to its own as at prefill
    (`models.attention.reread_mask`): the same queries a causal pass over the whole context
    would give there, for count / T of its projections and MLPs (`count` is a few hundred
    where the fits take a few thousand queries) and about half its attention per token; on a
    compacted row, the queries its tokens have over the cache as it is now, for a fraction of
    a pass over its whole logical history (online compaction re-compacts such rows). Else
    (a row never compacted with `count` >= T, a compacted one whose segment is not known) the
    whole context's causal pass. The pass is set up (the cache grown) here; it runs as the
    iterator is read."""
    engine = _as_engine(on_engine)
    n, length, logical = len(context_ids), cache.lengths[row], cache.logical[row]
    if logical == length:
        segment = 0  # every slot is a token (a segment always stands for more than its slots)
    own = 0 if segment is None or not 0 <= segment < length else length - segment
    # A sliding-window model's ring holds only the last positions: no token is read again.
    rereads = not model.config.local_layers
    if rereads and logical == n and own > 0 and (segment or count < n):
        generator = torch.Generator().manual_seed(seed)
        picked = torch.randperm(own, generator=generator)[:count].sort().values  # [n']
        first = n - own  # the context index of the first token slot
        ids = [context_ids[first + i] for i in picked.tolist()]
        slots = picked + (length - own)
        stages = _stages(model, ids, engine.pace, cache, row, reread=slots)
        positions = slots + (logical - length)
    else:
        positions = torch.arange(n)
        stages = _stages(model, context_ids, engine.pace)
    return ((q, positions) for q in engine.layers(stages, fitted_layers(model)))
