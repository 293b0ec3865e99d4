"""The engine's own thread, and the bridge between it and the server's event loop.

An engine (`engine.decoding.interface.Engine`) is only ever used from one thread: this one. Its loop
admits new sequences, runs one `step`, and hands each request's outputs to the asyncio queue of
the coroutine waiting for them; a request arrives as a function that builds its sequence (given
an `aborted()` check), and leaves as an async iterator of its outputs. A consumer that goes away
sets the abort flag; the engine drops the sequence at its next step.

Model work that is not a sequence (a session's prefill, prompt logprobs, a compaction's query
capture) is submitted as jobs (`submit`, `call`, `run`): each runs on this thread, one between
two steps, so the model is only ever used from here and long work, cut into pieces, never stops
decoding for longer than one piece.

Each step and job runs through the server's core share (`engine.core_share.CoreShare.run`: on
every core when this is the only busy thread, on one beside the others): busy while it has work,
idle (its cores handed to the other threads) while it waits for some.
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
from cdlm_serve.engine.decoding import Engine, EngineOutput

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than the server allows; answered with 429."""


_DONE = object()
JOB_FOLLOW_SECONDS = 0.002  # how long a turn with job time left waits for the next job


@dataclass(slots=True)
class _Request:
    id: str
    build: Callable[[str, Callable[[], bool]], Any]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[object]  # its EngineOutputs, then an exception or _DONE
    aborted: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _Job:
    """A piece of model work run on the engine thread between two steps."""

    fn: Callable[[], Any]
    result: Future[Any]


class EngineThread:
    def __init__(
        self,
        name: str,
        engine: Engine[Any, Any],  # either kind: requests arrive built (`stream`'s build)
        max_queue: int = 256,
        on_step: Callable[[float], None] | None = None,
        cores: CoreShare | None = None,
    ):
        self.name = name
        self.cores = cores or CoreShare.shared()  # with the process's other busy threads
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step  # called with each step's wall time (metrics)
        self._inbox: queue.Queue[_Request | _Job | None] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._stop = False
        # Jobs share this thread's time with the steps: between two steps they may run for as
        # long as the last step took (then at most one more job), so a long piece of work cut
        # into small jobs gets about half the thread, not one small job per step.
        self._last_step = 0.0
        self._turn_jobs = 0.0  # seconds of jobs since the last step
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

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on the engine thread between two steps (it may use the model freely);
        its result or exception arrives in the returned future. Requests already decoding wait
        for it, so keep each piece of work short: long work is cut into pieces and submitted
        one at a time, letting decode steps run in between. From any thread."""
        job = _Job(fn, Future())
        if self._stop or not self._thread.is_alive():
            job.result.set_exception(RuntimeError(f"{self.name}: the engine is shutting down"))
            return job.result
        self._inbox.put_nowait(job)
        return job.result

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`submit` for the event loop: await the result."""
        return await asyncio.wrap_future(self.submit(fn))

    def run(self, fn: Callable[[], Any]) -> Any:
        """`submit` for a thread that may block (a compaction thread): wait for the result."""
        future = self.submit(fn)
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
        """After the loop ends: nothing left in the inbox may wait forever."""
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(req, _Job):
                req.result.set_exception(RuntimeError(f"{self.name}: the engine has stopped"))
            elif req is not None:
                self._send(req, RuntimeError(f"{self.name}: the engine has stopped"))
                self._send(req, _DONE)

    def _loop(self) -> None:
        while True:
            if not self._admit(block=not self.engine.has_work()):
                break
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
            self._last_step, self._turn_jobs = elapsed, 0.0
            if self.on_step is not None:
                self.on_step(elapsed)
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
            if block:
                self.cores.leave()  # idle: the other busy threads get this one's cores
            try:
                if block:
                    req = self._inbox.get(timeout=0.5)
                elif 0 < self._turn_jobs < self._last_step:
                    # The job's owner submits its next piece as soon as it has the result.
                    req = self._inbox.get(timeout=JOB_FOLLOW_SECONDS)
                else:
                    req = self._inbox.get_nowait()
            except queue.Empty:
                return not (self._stop and not self.engine.has_work())
            if req is None:
                self._stop = True
                block = False
                continue
            if isinstance(req, _Job):
                started = time.perf_counter()
                self.cores.run(functools.partial(self._run_job, req))
                self._turn_jobs += time.perf_counter() - started
                if self.engine.has_work() and self._turn_jobs >= self._last_step:
                    return True  # the jobs had their time: decoding never waits for a queue
                block = block and not self.engine.has_work()
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

    @staticmethod
    def _run_job(job: _Job) -> None:
        if not job.result.set_running_or_notify_cancel():
            return
        try:
            job.result.set_result(job.fn())
        except BaseException as e:  # handed to the caller
            job.result.set_exception(e)

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
