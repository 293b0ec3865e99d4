"""Compactions of a session in the server: one compaction (`compact`: checked, run on the
compaction thread (`server.compaction_thread`), committed), and the online compactions a
session's policy asks for (`after_append`, `engine.compaction.auto`)."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from cdlm_serve.engine import heap
from cdlm_serve.engine.compaction import compact_row, resolve_key_queries
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import Session
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.schemas import CompactRequest
from cdlm_serve.server.session_access import load_cache, locked, persist, spill
from cdlm_serve.server.state import ServerState

log = logging.getLogger(__name__)
# A compaction must shrink what it compacts at least this much (smaller gains are not worth a
# fit, and `ratio` near 1 would ask OMP for almost every key).
MIN_RATIO = 1.5


async def compact(
    state: ServerState, served: ServedModel, session: Session, req: CompactRequest
) -> dict[str, Any]:
    """A requested compaction of the session: checked (400), run, committed."""
    try:
        resolve_key_queries(req.method, req.key_queries)
    except ValueError as e:
        raise APIError(400, str(e), param="key_queries") from None
    async with locked(state.sessions, session, state.settings.session_lock_wait):
        await load_cache(state, served, session)
        cache = session.cache
        if cache is None or cache.lengths[0] == 0:
            raise APIError(400, "the session's cache is empty", param="session_id")
        target = _target(cache.lengths[0], req)
        body = await _run(
            state,
            served,
            session,
            target,
            req.method,
            req.query_source,
            req.keep_recent,
            req.quantize,
            req.budgets,
            req.key_queries,
        )
    await spill(state.sessions)  # idle now: packed (int8, ragged) or spilled as the bound says
    return body


async def auto_compact(
    state: ServerState, served: ServedModel, session: Session
) -> dict[str, Any] | None:
    """The compaction the session's policy asks for now, if it still does once the session
    is locked (a request may have got there first); None if there is nothing to do."""
    async with locked(state.sessions, session, state.settings.session_lock_wait):
        policy = session.auto_compact
        if policy is None:
            return None
        await load_cache(state, served, session)
        physical = 0 if session.cache is None else session.cache.lengths[0]
        target = policy.target(physical)
        if not policy.due(physical) or target is None:
            return None
        body = await _run(
            state,
            served,
            session,
            target,
            policy.method,
            policy.query_source,
            policy.keep_recent,
            policy.quantize,
            policy.budgets,
            policy.key_queries,
            auto=True,
            longest=policy.longest(target),
        )
    await spill(state.sessions)
    return body


def _target(physical: int, req: CompactRequest) -> int:
    """The slots the compacted region gets, as the request asks (400 if it cannot)."""
    region = physical - req.keep_recent
    if region < 2:
        raise APIError(
            400,
            f"keep_recent={req.keep_recent} leaves too little of the {physical} cached "
            "tokens to compact",
            param="keep_recent",
        )
    if req.target_tokens is not None:
        if req.target_tokens * MIN_RATIO > region:
            raise APIError(
                400,
                f"target_tokens={req.target_tokens} must be at most 1/{MIN_RATIO} of the "
                f"{region} tokens to compact",
                param="target_tokens",
            )
        return req.target_tokens
    assert req.ratio is not None  # >= MIN_RATIO, the schema says so
    target = max(1, math.ceil(region / req.ratio))
    if target >= region:
        raise APIError(
            400, f"ratio={req.ratio} leaves the {region} tokens as they are", param="ratio"
        )
    return target


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
    target: int,
    method: str,
    query_source: str | None,
    keep_recent: int,
    quantize: str | None,
    budgets: str,
    key_queries: str | None,
    auto: bool = False,
    longest: int | None = None,
) -> dict[str, Any]:
    """Compact the locked session's loaded cache to `target` slots (plus the kept recent
    ones), commit it, and record it; the report."""
    cache = session.cache
    assert cache is not None
    # The fit works on the session's cache in place: whatever stops the compaction (a bad
    # option, a full disk at its commit), the session is its committed version again.
    try:
        try:
            report = await state.compactions.run(
                compact_row,
                served.model,
                served.tokenizer,
                cache,
                0,
                list(session.tokens),
                target,
                method,
                query_source,
                keep_recent,
                on_engine=served.thread.run,
                omp_budget=state.settings.compaction_omp_budget,
                urgent=served.thread.has_requests,
                quantize=quantize,
                budgets=budgets,
                schedule=served.budget_schedule,
                key_queries=key_queries,
                segment_slots=_segment_slots(session),
                longest=longest,
            )
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
        await persist(state.sessions, session)
        state.metrics.compaction_seconds.labels(method).observe(report.seconds["total"])
        state.metrics.compaction_ratio.labels(method).observe(report.ratio)
        return body
    except BaseException:
        state.sessions.revert(session)
        raise


def after_append(state: ServerState, served: ServedModel, session: Session) -> None:
    """The session grew: the compaction its policy asks for, if due, in the background."""
    state.compactions.after_append(session, lambda: auto_compact(state, served, session))
