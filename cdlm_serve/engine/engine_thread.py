"""The engine's own thread, and the bridge between it and the server's event loop.

An engine (`engine.decoding.interface.Engine`) is only ever used from one thread: this one. Its loop
admits new sequences, runs one `step`, and hands each request's outputs to the asyncio queue of
the coroutine waiting for them; a request arrives as a function that builds its sequence (given
an `aborted()` check), and leaves as an async iterator of its outputs. A consumer that goes away
sets the abort flag; the engine drops the sequence at its next step.

Model work that is not a sequence (a compaction's pieces) is submitted as work with a priority
(`submit`, `call`, `run`) into the engine's `WorkQueue`, which says when each piece runs: between
two steps, for its priority's share of the thread (`engine.decoding.work_queue`). This thread only
executes what the engine's scheduler and work queue hand it, so the model is only ever used from
here, and long work, cut into pieces, never stops decoding for longer than one piece.

Each step and piece of work runs through the server's core share (`engine.core_share.CoreShare.
run`: on every core when this is the only busy thread, on one beside the others): busy while it
has work, idle (its cores handed to the other threads) while it waits for some.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

from cdlm_serve.engine.core_share import CoreShare
from cdlm_serve.engine.decoding import Engine, EngineOutput, Priority, Work

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than the server allows; answered with 429."""


_DONE = object()
WORK_FOLLOW_SECONDS = 0.002  # how long a turn with work time left waits for the next piece
# An engine idle this long gives back its batch caches (Engine.release_idle): a server at rest
# holds its weights and caches of what it keeps (prefix blocks, sessions), not the working
# memory of its last burst. Long enough that a client's think time between turns keeps them.
IDLE_RELEASE_SECONDS = 20.0


@dataclass(slots=True)
class _Request:
    id: str
    build: Callable[[str, Callable[[], bool]], Any]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[object]  # its EngineOutputs, then an exception or _DONE
    aborted: threading.Event = field(default_factory=threading.Event)


class EngineThread:
    def __init__(
        self,
        name: str,
        engine: Engine[Any, Any],  # either kind: requests arrive built (`stream`'s build)
        max_queue: int = 256,
        on_step: Callable[[float], None] | None = None,
        cores: CoreShare | None = None,
        idle_release_s: float = IDLE_RELEASE_SECONDS,
    ):
        self.name = name
        self.idle_release_s = idle_release_s
        self._idle_since: float | None = None  # when the thread last ran out of work
        self._released = False  # this idle spell's release is done
        self.cores = cores or CoreShare.shared()  # with the process's other busy threads
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step  # called with each step's wall time (metrics)
        self._inbox: queue.Queue[_Request | Work | None] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"batch-{name}", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests not yet decoding: in the inbox or in the engine's waiting list. Read from
        other threads without a lock: a snapshot, good enough for admission and gauges."""
        return self._inbox.qsize() + self.engine.num_waiting()

    @property
    def running(self) -> int:
        return self.engine.num_running()

    def has_requests(self) -> bool:
        """Requests are decoding or waiting (a snapshot, from any thread): decode steps would
        wait for a job now."""
        return self.running > 0 or self.waiting > 0

    def full(self) -> bool:
        return self.waiting >= self.max_queue

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish what is in flight, then stop."""
        self._inbox.put(None)
        self._thread.join(timeout)

    async def stream(
        self, build: Callable[[str, Callable[[], bool]], Any]
    ) -> AsyncIterator[EngineOutput]:
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
                yield cast(EngineOutput, item)  # what the engine's step returned
        finally:
            req.aborted.set()

    def submit(self, fn: Callable[[], Any], priority: Priority = Priority.REQUEST) -> Future[Any]:
        """Run `fn()` on the engine thread between two steps (it may use the model freely), when
        the engine's work queue gives it its turn; its result or exception arrives in the
        returned future. Requests already decoding wait for it, so keep each piece short: long
        work is cut into pieces and submitted one at a time. From any thread."""
        work = self.engine.work.make(fn, priority)
        if self._stop or not self._thread.is_alive():
            work.result.set_exception(RuntimeError(f"{self.name}: the engine is shutting down"))
            return work.result
        self._inbox.put_nowait(work)
        return work.result

    async def call(self, fn: Callable[[], Any], priority: Priority = Priority.REQUEST) -> Any:
        """`submit` for the event loop: await the result."""
        return await asyncio.wrap_future(self.submit(fn, priority))

    def run(self, fn: Callable[[], Any], priority: Priority = Priority.REQUEST) -> Any:
        """`submit` for a thread that may block (a compaction thread): wait for the result."""
        future = self.submit(fn, priority)
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive() and not future.running():
                    raise RuntimeError(f"{self.name}: the engine has stopped") from None

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.cores.leave()
            self._stop = True
            self._drain()

    def _drain(self) -> None:
        """After the loop ends: nothing left in the inbox or the work queue may wait forever."""
        stopped = RuntimeError(f"{self.name}: the engine has stopped")
        for work in self.engine.work.drain():
            work.result.set_exception(stopped)
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(req, Work):
                req.result.set_exception(stopped)
            elif req is not None:
                self._send(req, stopped)
                self._send(req, _DONE)

    def _busy(self) -> bool:
        return self.engine.has_work() or len(self.engine.work) > 0

    def _loop(self) -> None:
        work = self.engine.work
        while True:
            if not self._admit(block=not self._busy()):
                break
            if self._work_turn():  # a piece of work ran: admission again, then maybe more
                continue
            if not self.engine.has_work():
                continue
            try:
                started = time.perf_counter()
                outputs = self.cores.run(self.engine.step)
                elapsed = time.perf_counter() - started
            except Exception as e:  # fail everyone in flight; the engine state is suspect
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            work.stepped(elapsed)
            if self.on_step is not None:
                self.on_step(elapsed)
            self._deliver(outputs)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """Each output to its request. A method of its own so that no finished request (its
        sequence builder, and through it a session and its cache) stays referenced by a local
        variable while the thread waits for the next one."""
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            self._send(req, out)
            if out.finish_reason is not None:
                self._send(req, _DONE)
                del self._live[req.id]

    def _work_turn(self) -> bool:
        """Run the piece of work the queue says is due now, if any. A method of its own so that
        nothing of the piece (its closure, its result) stays referenced while the thread waits
        for the next request: a compaction's caches would live on with it (issue 42)."""
        work = self.engine.work
        piece = work.next(decoding=self.engine.has_work())
        if piece is None:
            return False
        started = time.perf_counter()
        self.cores.run(functools.partial(self._run_work, piece))
        work.worked(time.perf_counter() - started)
        return True

    def _admit(self, block: bool) -> bool:
        """Move new requests into the engine and new work into its queue; False once shutdown
        was asked and nothing is left to do."""
        while True:
            if block:
                self.cores.leave()  # idle: the other busy threads get this one's cores
            try:
                if block:
                    req = self._inbox.get(timeout=0.5)
                elif self.engine.work.has_time() and not self.engine.work:
                    # The work's owner submits its next piece as soon as it has the result.
                    req = self._inbox.get(timeout=WORK_FOLLOW_SECONDS)
                else:
                    req = self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    self._idle()
                return not (self._stop and not self._busy())
            self._idle_since, self._released = None, False
            if req is None:
                self._stop = True
                block = False
                continue
            if isinstance(req, Work):
                self.engine.work.add(req)
                block = False
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

    def _idle(self) -> None:
        """Nothing to do for one more wait: once for `idle_release_s` in a row, the engine
        releases its batch caches (once a spell; the next request ends it)."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._released and now - self._idle_since >= self.idle_release_s:
            self._released = True
            self.engine.release_idle()

    @staticmethod
    def _run_work(work: Work) -> None:
        if not work.result.set_running_or_notify_cancel():
            return
        try:
            work.result.set_result(work.fn())
        except BaseException as e:  # handed to the caller
            work.result.set_exception(e)

    def _fail_all(self, error: Exception) -> None:
        for req in self._live.values():
            self._send(req, error)
            self._send(req, _DONE)
        self._live.clear()
        self.engine.reset()

    @staticmethod
    def _send(req: _Request, value: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.out.put_nowait, value)
        except RuntimeError:  # the event loop is closed (server shutting down)
            req.aborted.set()
