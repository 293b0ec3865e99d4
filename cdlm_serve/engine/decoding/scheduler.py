"""Which sequences run, in which rows: the row scheduler both engines use.

An engine holds sequences in batches ("groups": the AR engine has one, the diffusion engine one
per decoding mode, each its own KV cache). A sequence waits in one queue, joins its group in
arrival order while the group has fewer than `max_batch` rows (a full group never holds back
another's sequences), takes the next free row, and leaves between steps; the group's last row
then moves into the freed one, so a group's rows are always 0..n-1. A client that goes away
is noticed at the next step, waiting or running, and its sequence leaves with "abort".

Each engine's step reads: `schedule` (aborts, admission) -> run its groups -> `retire_finished`.

Beside the sequences, the scheduler holds the engine's queue of other model work
(`engine.decoding.work_queue.WorkQueue`): the engine thread only executes what the two hand it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from cdlm_serve.engine.decoding.interface import EngineOutput
from cdlm_serve.engine.decoding.work_queue import WorkQueue


class Scheduled(Protocol):
    """What the scheduler reads and writes on a sequence (ARSequence, DLMSequence)."""

    id: str
    row: int
    finish_reason: str | None
    admitted: float | None

    def aborted(self) -> bool: ...


S = TypeVar("S", bound=Scheduled)


class Scheduler(Generic[S]):
    def __init__(
        self,
        max_batch: int,
        group_of: Callable[[S], str],
        abort_output: Callable[[S], EngineOutput],
        move_row: Callable[[str, int, int], None],
        release: Callable[[S], None] = lambda seq: None,
    ):
        """`group_of(seq)` names its batch; `abort_output(seq)` is the output of a sequence
        that leaves aborted; `move_row(group, src, dst)` moves a cache row when a row is
        freed; `release(seq)` is the engine's own work as a sequence leaves (before its row is
        taken: a session write-back)."""
        self.max_batch = max_batch
        self.group_of = group_of
        self.abort_output = abort_output
        self.move_row = move_row
        self.release = release
        self.waiting: list[S] = []
        self.running: dict[str, list[S]] = {}
        self.work = WorkQueue()  # model work between the steps (not sequences)
        # Called with every sequence that leaves (finished, aborted running or waiting):
        # metrics, tracing.
        self.on_finish: Callable[[S], None] | None = None

    # ---- queue ---------------------------------------------------------------------------
    def add(self, seq: S) -> None:
        self.waiting.append(seq)

    def group(self, name: str) -> list[S]:
        """The running sequences of one group; row i is group[i]."""
        return self.running.setdefault(name, [])

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.running.values())

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return sum(len(g) for g in self.running.values())

    def reset(self) -> None:
        self.waiting.clear()
        self.running.clear()

    # ---- a step ----------------------------------------------------------------------------
    def schedule(self, outputs: list[EngineOutput]) -> dict[str, list[S]]:
        """Start of a step: aborted sequences leave (an output each, appended to `outputs`),
        then waiting ones join their groups while there is room. Returns the sequences that
        joined, per group (rows consecutive, after the group's earlier rows)."""
        for group in list(self.running.values()):
            for seq in [s for s in group if s.aborted()]:
                seq.finish_reason = "abort"
                outputs.append(self.abort_output(seq))
                self._retire(seq)
        joined: dict[str, list[S]] = {}
        still_waiting: list[S] = []
        for seq in self.waiting:
            if seq.aborted():  # never admitted: nothing to undo
                seq.finish_reason = "abort"
                outputs.append(self.abort_output(seq))
                self._finished(seq)
                continue
            name = self.group_of(seq)
            group = self.group(name)
            if len(group) >= self.max_batch:
                still_waiting.append(seq)
                continue
            seq.row = len(group)
            seq.admitted = time.perf_counter()
            group.append(seq)
            joined.setdefault(name, []).append(seq)
        self.waiting = still_waiting
        return joined

    def retire_finished(self) -> None:
        """End of a step: every sequence with a finish reason leaves its row."""
        for group in list(self.running.values()):
            for seq in [s for s in group if s.finish_reason is not None]:
                self._retire(seq)

    def _retire(self, seq: S) -> None:
        self.release(seq)
        name = self.group_of(seq)
        group = self.running[name]
        last = group[-1]
        if last is not seq:
            self.move_row(name, last.row, seq.row)
        group[seq.row] = last
        last.row = seq.row
        group.pop()
        self._finished(seq)

    def _finished(self, seq: S) -> None:
        if self.on_finish is not None:
            self.on_finish(seq)


class ScheduledEngine(Generic[S]):
    """What both engines answer from their scheduler (the rest of
    `engine.decoding.interface.Engine` is each engine's own)."""

    scheduler: Scheduler[S]

    @property
    def work(self) -> WorkQueue:
        return self.scheduler.work

    def add(self, seq: S) -> None:
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting()

    def num_running(self) -> int:
        return self.scheduler.num_running()

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch
