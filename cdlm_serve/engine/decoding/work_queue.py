"""Model work that is not a sequence (a compaction's pieces: its query capture and staged
forwards), queued on an engine by priority: each piece runs between two decode steps, for as
long as its priority's share of the last step's time allows (`WorkQueue.next`), so the engine
thread only executes what the engine's scheduler and this queue hand it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class Priority(IntEnum):
    """Model work's priority: lower runs first, and may take a larger share of the thread."""

    REQUEST = 0  # a client waits for it (a compaction it asked for)
    BACKGROUND = 1  # nobody waits (an online compaction after an append)


# Between two decode steps, work of a priority may run for this share of the last step's time
# (then at most one more piece): a long compaction cut into pieces a decode step long gets about
# half the thread at REQUEST, a third at BACKGROUND, and decoding is never held up for longer.
SHARE = {Priority.REQUEST: 1.0, Priority.BACKGROUND: 0.5}


@dataclass(order=True, slots=True)
class Work:
    """A piece of model work: `fn()` runs on the engine thread; its result or error goes to
    `result`. Ordered by priority, then arrival."""

    priority: Priority
    order: int
    fn: Callable[[], Any] = field(compare=False)
    result: Future[Any] = field(compare=False, default_factory=Future)


class WorkQueue:
    """The engine's model work, in priority order, and when it may run. Only the engine thread
    calls `next`, `stepped` and `worked`; `len()` is read from any thread as a snapshot."""

    def __init__(self) -> None:
        self._heap: list[Work] = []
        self._order = itertools.count()
        self._last_step = 0.0  # seconds the last decode step took
        self._turn = 0.0  # seconds of work run since then
        self._share = 1.0  # the share of the last piece's priority

    def __len__(self) -> int:
        return len(self._heap)

    def make(self, fn: Callable[[], Any], priority: Priority) -> Work:
        return Work(priority, next(self._order), fn)

    def add(self, work: Work) -> None:
        heapq.heappush(self._heap, work)

    def next(self, decoding: bool) -> Work | None:
        """The piece to run now, or None: the next decode step comes first. With nothing
        `decoding`, work has the thread; else a turn between two steps runs pieces while it
        has used less than its share of the last step's time."""
        if not self._heap:
            return None
        share = SHARE[self._heap[0].priority]
        if decoding and self._turn >= self._last_step * share:
            return None
        self._share = share
        return heapq.heappop(self._heap)

    def has_time(self) -> bool:
        """The turn has time left: a next piece, submitted as soon as this one's result is
        back, is worth waiting a moment for."""
        return 0 < self._turn < self._last_step * self._share

    def worked(self, seconds: float) -> None:
        self._turn += seconds

    def stepped(self, seconds: float) -> None:
        self._last_step, self._turn = seconds, 0.0

    def drain(self) -> list[Work]:
        """Everything still queued (the thread is stopping: each is failed)."""
        out, self._heap = self._heap, []
        return out
