"""Compactions in the server: the compaction thread and its queue, one compaction of a
session (`compact`: checked, run, committed), and the online compactions a session's policy
asks for (`Compactions.after_append`, `engine.auto_compaction`).

A compaction's model work (its reference queries' forwards) runs in pieces on the model's
engine thread between decode steps (`EngineThread.run`); its fits run on the compaction
thread, one compaction at a time, at most `MAX_WAITING_COMPACTIONS` more waiting (then 429).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from engine.core_share import CoreShare
from engine.kv_compaction import OnEngine, compact_row, resolve_key_queries
from engine.served_model import ServedModel
from engine.session_store import Session
from server.errors import APIError
from server.schemas import CompactRequest
from server.session_access import load_cache, locked, persist, spill, unstoppable

if TYPE_CHECKING:
    from server.app import ServerState

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_WAITING_COMPACTIONS = 4
# A compaction must shrink what it compacts at least this much (smaller gains are not worth a
# fit, and `ratio` near 1 would ask OMP for almost every key).
MIN_RATIO = 1.5


class Compactions:
    """The compaction thread, and how many compactions are in it (running or waiting)."""

    def __init__(self, cores: CoreShare) -> None:
        self.cores = cores  # the fits run on the thread's share, beside the engine threads
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compaction")
        self._count = 0
        self._lock = threading.Lock()
        self._auto: dict[str, asyncio.Task] = {}  # session id -> its pending online compaction

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        with self._lock:
            if self._count > MAX_WAITING_COMPACTIONS:
                raise APIError(
                    429,
                    f"{self._count} compactions are already running or waiting; try again",
                    headers={"Retry-After": "10"},
                )
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1

    async def run(self, fn, *args: Any, on_engine: OnEngine, **kwargs: Any) -> Any:
        """`fn(*args, on_engine=..., on_fit=..., **kwargs)` on the compaction thread. It counts
        as busy in the core share while it fits (each fit through the share, `on_fit`), and as
        idle while a piece of its model work runs on the engine thread (`on_engine`)."""

        def piece(work: Callable[[], T]) -> T:
            self.cores.leave()
            try:
                return on_engine(work)
            finally:
                self.cores.enter()

        def job() -> Any:
            with self.cores.working():
                return fn(*args, on_engine=piece, on_fit=self.cores.run, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

    def after_append(self, state: ServerState, served: ServedModel, session: Session) -> None:
        """The session grew (its change committed, its lock released): start the compaction
        its policy asks for, if it asks for one now, in the background. On the event loop."""
        policy = session.auto_compact
        if policy is None or session.id in self._auto:
            return
        physical = session.cache.lengths[0] if session.cache is not None else 0
        if session.cache is None and session.version is not None:
            physical = session.version.length
        if not policy.due(physical):
            return
        task = asyncio.ensure_future(self._auto_compact(state, served, session))
        self._auto[session.id] = task
        session.auto_pending = True  # said before the request that grew it is answered

        def done(_: asyncio.Task) -> None:
            self._auto.pop(session.id, None)
            session.auto_pending = False

        task.add_done_callback(done)

    async def _auto_compact(self, state: ServerState, served: ServedModel, session: Session):
        try:
            async with self.slot():
                body = await unstoppable(auto_compact(state, served, session))
        except APIError as e:  # busy, full queue, ...: the next append asks again
            log.info("session %s: online compaction skipped (%s)", session.id, e.message)
            return
        except Exception:  # never the request's: it has its answer already
            log.exception("session %s: online compaction failed", session.id)
            return
        if body is not None:
            log.info(
                "session %s: compacted online %s -> %s slots in %.1f s",
                session.id,
                body["tokens_before"],
                body["tokens_after"],
                body["seconds"]["total"],
            )

    def shutdown(self) -> None:
        for task in list(self._auto.values()):
            task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)


async def compact(
    state: ServerState, served: ServedModel, session: Session, req: CompactRequest
) -> dict:
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


async def auto_compact(state: ServerState, served: ServedModel, session: Session) -> dict | None:
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
) -> dict:
    """Compact the locked session's loaded cache to `target` slots (plus the kept recent
    ones), commit it, and record it; the report."""
    cache = session.cache
    assert cache is not None
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
    await asyncio.to_thread(cache.trim)
    session.rewrite(cache, codes=report.codes)
    await persist(state.sessions, session)
    state.metrics.compaction_seconds.labels(method).observe(report.seconds["total"])
    state.metrics.compaction_ratio.labels(method).observe(report.ratio)
    return body
