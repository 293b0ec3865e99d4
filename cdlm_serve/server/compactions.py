"""Compactions of a session in the server: one compaction (`compact`: checked, run on the
compaction thread (`server.compaction_thread`), committed), and the online compactions a
session's policy asks for (`after_append`, `engine.compaction.auto`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from cdlm_serve.engine import heap
from cdlm_serve.engine.compaction import (
    CompactionRuntime,
    CompactionSpec,
    SpecError,
    compact_row,
    resolve_auto,
)
from cdlm_serve.engine.decoding import Priority
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import Session
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.schemas import CompactOptions
from cdlm_serve.server.session_access import opened, spill
from cdlm_serve.server.state import ServerState

log = logging.getLogger(__name__)


def compaction_spec(options: CompactOptions, default_ratio: float | None = None) -> CompactionSpec:
    """The compaction a request asks for, checked where it enters (400 naming the field at
    fault): by its ratio or to its target_tokens, one of them; or by `default_ratio` where
    the route has one and the request gives neither."""
    ratio, target = options.ratio, options.target_tokens
    which = "exactly" if default_ratio is None else "at most"
    if ratio is not None and target is not None:
        raise APIError(400, f"give {which} one of ratio and target_tokens", param="ratio")
    if ratio is None and target is None:
        if default_ratio is None:
            raise APIError(400, f"give {which} one of ratio and target_tokens", param="ratio")
        ratio = default_ratio
    name, budgets = resolve_auto(options.method, options.budgets, options.query_source)
    try:
        return CompactionSpec(
            method=name,
            ratio=ratio,
            target_tokens=target,
            query_source=options.query_source,
            keep_recent=options.keep_recent,
            quantize=options.quantize,
            budgets=budgets,
            key_queries=options.key_queries,
        )
    except SpecError as e:
        raise APIError(400, str(e), param=e.param) from None


async def compact(
    state: ServerState, served: ServedModel, session: Session, spec: CompactionSpec
) -> dict[str, Any]:
    """A requested compaction of the session: run, committed (400 if its cache cannot be
    compacted as `spec` asks); on any failure the session is as it was."""
    async with opened(state, session, write=True, served=served):
        cache = session.cache
        if cache is None or cache.lengths[0] == 0:
            raise APIError(400, "the session's cache is empty", param="session_id")
        try:
            spec.target(cache.lengths[0])  # checked before the cache changes
        except SpecError as e:
            raise APIError(400, str(e), param=e.param) from None
        body = await _run(state, served, session, spec)
    _observe(state, spec, body)  # once committed
    # Idle now: packed (int8, ragged) or spilled as the bound says.
    await spill(state.session_service)
    return body


async def auto_compact(
    state: ServerState, served: ServedModel, session: Session
) -> dict[str, Any] | None:
    """The compaction the session's policy asks for now, if it still does once the session
    is held (a request may have got there first); None if there is nothing to do."""
    policy = session.auto_compact
    if policy is None:
        return None
    async with opened(state, session, write=True, served=served):
        physical = 0 if session.cache is None else session.cache.lengths[0]
        target = policy.target(physical)
        if not policy.due(physical) or target is None:
            return None
        body = await _run(state, served, session, policy.spec, True, policy.longest(target))
    _observe(state, policy.spec, body)
    await spill(state.session_service)
    return body


def _segment_slots(session: Session) -> int | None:
    """The slots of the compacted segment that starts the session's cache: its last
    compaction's (None before any)."""
    last = session.compactions[-1] if session.compactions else {}
    slots = last.get("segment_slots")
    return slots if type(slots) is int else None


async def _run(
    state: ServerState,
    served: ServedModel,
    session: Session,
    spec: CompactionSpec,
    auto: bool = False,
    longest: int | None = None,
) -> dict[str, Any]:
    """Compact the held session's loaded cache as `spec` asks (`auto`: its online policy's,
    whose `longest` bounds one head) and record it; the report. The fit works on the cache in
    place: the session service commits it, or rolls it back on any failure."""
    cache = session.cache
    assert cache is not None
    runtime = CompactionRuntime(
        tokenizer=served.tokenizer,
        # Model work a client waits for goes before an online compaction's, and takes more of
        # the engine thread's time between two steps.
        on_engine=functools.partial(
            served.thread.run, priority=Priority.BACKGROUND if auto else Priority.REQUEST
        ),
        omp_budget=state.settings.compaction_omp_budget,
        urgent=served.thread.has_requests,
        schedule=served.budget_schedule,
        segment_slots=_segment_slots(session),
        longest=longest,
    )
    tokens = list(session.tokens)
    try:
        report = await state.compactions.run(
            lambda run: compact_row(served.model, cache, 0, tokens, spec, run), runtime
        )
    except SpecError as e:
        raise APIError(400, str(e), param=e.param) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    body = report.to_dict() | {"auto": auto}
    session.compactions.append(body)
    # The reference pass grew it to ~2x the context; it now holds t + recent (a copy of what
    # is left, off the event loop).
    grown = cache.allocated_bytes()
    await asyncio.to_thread(cache.trim)
    heap.freed(grown - cache.allocated_bytes())
    session.rewrite(cache, codes=report.codes)
    return body


def _observe(state: ServerState, spec: CompactionSpec, body: dict[str, Any]) -> None:
    state.metrics.compaction_seconds.labels(spec.method).observe(body["seconds"]["total"])
    state.metrics.compaction_ratio.labels(spec.method).observe(body["ratio"])


def after_append(state: ServerState, served: ServedModel, session: Session) -> None:
    """The session grew: the compaction its policy asks for, if due, in the background."""
    state.compactions.after_append(session, lambda: auto_compact(state, served, session))
