"""Run a batching engine's step loop on its own thread; requests join and leave between steps.

The engine interface is small: `add(seq)`, `step() -> outputs` (each with a `request_id` and a
`finish_reason` that is set on its last output), `has_work()`. Each request arrives as a
function that builds its sequence (given an `aborted()` check), and leaves as an async
iterator of its outputs. A consumer that goes away sets the abort flag; the engine drops the
sequence at its next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than the server allows; answered with 429."""


_DONE = object()


class BatchingEngine(Protocol):
    def add(self, seq: Any) -> None: ...
    def step(self) -> list[Any]: ...
    def has_work(self) -> bool: ...


@dataclass(slots=True)
class _Request:
    id: str
    build: Callable[[str, Callable[[], bool]], Any]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    aborted: threading.Event = field(default_factory=threading.Event)
    exclusive: bool = False  # a job run on the engine thread between steps, not a sequence


class BatchWorker:
    def __init__(
        self,
        name: str,
        engine: BatchingEngine,
        max_queue: int = 256,
        on_step: Callable[[float], None] | None = None,
    ):
        self.name = name
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step  # called with each step's wall time (metrics)
        self._inbox: queue.Queue[_Request | None] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"batch-{name}", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests not yet decoding: in the inbox or in the engine's waiting list. Read from
        other threads without a lock: a snapshot, good enough for admission and gauges."""
        return self._inbox.qsize() + len(getattr(self.engine, "waiting", ()))

    @property
    def running(self) -> int:
        return max(0, len(self._live) - len(getattr(self.engine, "waiting", ())))

    def full(self) -> bool:
        return self.waiting >= self.max_queue

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish what is in flight, then stop."""
        self._inbox.put(None)
        self._thread.join(timeout)

    async def stream(self, build: Callable[[str, Callable[[], bool]], Any]) -> AsyncIterator[Any]:
        """`build(request_id, aborted)` makes the engine sequence (on the engine thread)."""
        req = _Request(
            f"{self.name}-{next(self._ids)}", build, asyncio.get_running_loop(), asyncio.Queue()
        )
        if self.full():
            raise QueueFull(f"{self.name}: {self.waiting} requests are already waiting")
        self._inbox.put_nowait(req)
        try:
            while True:
                item = await req.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.aborted.set()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between two steps (it may use the model freely) and
        return its result. Requests already decoding wait for it; it does not wait for them."""
        req = _Request(
            f"{self.name}-job-{next(self._ids)}",
            lambda *_: fn,
            asyncio.get_running_loop(),
            asyncio.Queue(),
            exclusive=True,
        )
        self._inbox.put_nowait(req)
        item = await req.out.get()
        if isinstance(item, BaseException):
            raise item
        return item

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._admit(block=not self.engine.has_work()):
                break
            if not self.engine.has_work():
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # fail everyone in flight; the engine state is suspect
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            if self.on_step is not None:
                self.on_step(time.perf_counter() - started)
            for out in outputs:
                req = self._live.get(out.request_id)
                if req is None:
                    continue
                self._send(req, out)
                if out.finish_reason is not None:
                    self._send(req, _DONE)
                    del self._live[req.id]

    def _admit(self, block: bool) -> bool:
        """Move new requests into the engine; False once shutdown was asked and nothing is
        left to do."""
        while True:
            try:
                req = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return not (self._stop and not self.engine.has_work())
            if req is None:
                self._stop = True
                block = False
                continue
            if req.exclusive:
                try:
                    self._send(req, req.build(req.id, req.aborted.is_set)())
                except Exception as e:  # handed to the caller
                    self._send(req, e)
                continue
            try:
                seq = req.build(req.id, req.aborted.is_set)
            except Exception as e:  # a bad request: only its caller hears of it
                self._send(req, e)
                self._send(req, _DONE)
                continue
            self._live[req.id] = req
            self.engine.add(seq)
            block = False

    def _fail_all(self, error: Exception) -> None:
        for req in self._live.values():
            self._send(req, error)
            self._send(req, _DONE)
        self._live.clear()
        reset = getattr(self.engine, "reset", None)
        if reset is not None:
            reset()

    @staticmethod
    def _send(req: _Request, value: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.out.put_nowait, value)
        except RuntimeError:  # the event loop is closed (server shutting down)
            req.aborted.set()
