"""The compaction thread and its queue: one compaction fits at a time, at most
`MAX_WAITING_COMPACTIONS` more wait (then 429), and the online compactions a session's policy
asks for run in the background after the append that made them due.

A compaction's model work (its reference queries' forwards) runs in pieces on the model's
engine thread between decode steps (`EngineThread.run`); its fits run here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from cdlm_serve.engine.compaction import CompactionRuntime
from cdlm_serve.engine.core_share import CoreShare
from cdlm_serve.engine.sessions import Session
from cdlm_serve.server.errors import APIError

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
MAX_WAITING_COMPACTIONS = 4


class Compactions:
    """The compaction thread, and how many compactions are in it (running or waiting)."""

    def __init__(self, cores: CoreShare) -> None:
        self.cores = cores  # the fits run on the thread's share, beside the engine threads
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compaction")
        self._count = 0
        self._lock = threading.Lock()
        # session id -> its pending online compaction
        self._auto: dict[str, asyncio.Task[None]] = {}

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

    async def run(self, fn: Callable[[CompactionRuntime], R], runtime: CompactionRuntime) -> R:
        """`fn(runtime)` on the compaction thread, with `runtime.on_engine` and `on_fit` as
        this thread runs them: it counts as busy in the core share while it fits (each fit
        through the share, `on_fit`), and as idle while a piece of its model work runs on the
        engine thread (`runtime.on_engine`)."""
        on_engine = runtime.on_engine

        def piece(work: Callable[[], T]) -> T:
            self.cores.leave()
            try:
                result: T = on_engine(work)  # work's own result
                return result
            finally:
                self.cores.enter()

        def job() -> R:
            with self.cores.working():
                return fn(replace(runtime, on_engine=piece, on_fit=self.cores.run))

        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

    def after_append(
        self, session: Session, compaction: Callable[[], Awaitable[dict[str, Any] | None]]
    ) -> None:
        """The session grew (its change committed, its lock released): start the compaction
        its policy asks for (`compaction()`), if it asks for one now, in the background. On the
        event loop."""
        policy = session.auto_compact
        if policy is None or session.id in self._auto:
            return
        physical = session.cache.lengths[0] if session.cache is not None else 0
        if session.cache is None and session.version is not None:
            physical = session.version.length
        if not policy.due(physical):
            return
        task = asyncio.ensure_future(self._auto_compact(session, compaction))
        self._auto[session.id] = task
        session.auto_pending = True  # said before the request that grew it is answered

        def done(_: asyncio.Task[None]) -> None:
            self._auto.pop(session.id, None)
            session.auto_pending = False

        task.add_done_callback(done)

    async def _auto_compact(
        self, session: Session, compaction: Callable[[], Awaitable[dict[str, Any] | None]]
    ) -> None:
        try:
            async with self.slot():
                # Finished even if cancelled (server.session_access.unstoppable's reason).
                body = await asyncio.shield(asyncio.ensure_future(compaction()))
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
