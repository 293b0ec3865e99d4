"""Run engine work on one dedicated thread and hand its results to asyncio.

The model is not thread-safe and the machine's cores are already busy inside each forward, so
one thread per model runs jobs in order. A job is a function that takes an `aborted()` check
and yields results; `stream` turns it into an async iterator for the HTTP layer. A consumer
that goes away (client disconnect) sets the abort flag, and the job stops at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Job = Callable[[Callable[[], bool]], Iterator[Any]]

_DONE = object()


class QueueFull(RuntimeError):
    pass


@dataclass(slots=True)
class _Item:
    job: Job
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    aborted: threading.Event = field(default_factory=threading.Event)


class EngineWorker:
    def __init__(self, name: str, max_queue: int = 256):
        self.name = name
        self._jobs: queue.Queue[_Item | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish queued jobs, then stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    async def stream(self, job: Job) -> AsyncIterator[Any]:
        item = _Item(job, asyncio.get_running_loop(), asyncio.Queue())
        try:
            self._jobs.put_nowait(item)
        except queue.Full:
            raise QueueFull(f"{self.name}: too many requests waiting") from None
        try:
            while True:
                result = await item.out.get()
                if result is _DONE:
                    return
                if isinstance(result, BaseException):
                    raise result
                yield result
        finally:
            # Normal end, error, or the consumer went away: the job must not keep running.
            item.aborted.set()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            if item.aborted.is_set():
                continue
            try:
                for result in item.job(item.aborted.is_set):
                    self._send(item, result)
                    if item.aborted.is_set():
                        break
            except Exception as e:  # handed to the consumer, which turns it into an HTTP error
                log.exception("engine job failed")
                self._send(item, e)
            self._send(item, _DONE)

    @staticmethod
    def _send(item: _Item, value: Any) -> None:
        try:
            item.loop.call_soon_threadsafe(item.out.put_nowait, value)
        except RuntimeError:  # the event loop is closed (server shutting down)
            item.aborted.set()
