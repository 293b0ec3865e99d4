"""The CPU cores, shared evenly among the threads that have model work right now.

Each served model has an engine thread and a compaction fits on a thread of its own; each would
use every core (torch's intra-op threads) if left alone, and two busy at once would run more
threads than there are cores, with OpenMP's barriers waiting for threads the OS has descheduled.
So a thread says when it starts a piece of work (`enter`, at every step or job) and when it has
none (`leave`), and each piece runs on `cores // busy` intra-op threads. Measured in one process
without HTTP (SmolLM2 and the CDLM student, fp32, 2 cores, each engine alone on both cores vs
both busy on one core each): AR 39.7 -> 40.3 tok/s, DLM 50.7 -> 62.7 tok/s. Taking turns (one
engine at a time on every core, fair by time) was tried and kept only ~0.5x each.

torch's thread count is per thread (OpenMP's team size and MKL's local setting), but
`torch.set_num_threads` also sets the default a thread created later starts with: every thread
that works here sets its own count at each piece, so that default does not matter to them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class CoreShare:
    """One per server: every model's engine thread and the compaction thread share it. Made on
    the main thread, whose thread count (all cores, or OMP_NUM_THREADS) is the total."""

    def __init__(self, cores: int | None = None):
        self.cores = cores or torch.get_num_threads()
        self._busy: set[int] = set()
        self._lock = threading.Lock()

    @property
    def busy(self) -> int:
        return len(self._busy)

    # ---- intra-op threads ---------------------------------------------------------------------
    def enter(self) -> int:
        """The calling thread starts a piece of work: it counts as busy, and runs on its share
        of the cores from now on (returned). Call again at each piece: the share follows how
        many others are busy."""
        with self._lock:
            self._busy.add(threading.get_ident())
            share = max(1, self.cores // len(self._busy))
        if torch.get_num_threads() != share:
            torch.set_num_threads(share)
        return share

    def leave(self) -> None:
        """The calling thread has no work for now (it is about to wait)."""
        with self._lock:
            self._busy.discard(threading.get_ident())

    @contextmanager
    def working(self) -> Iterator[int]:
        """Work beside the engine threads (a compaction's fits), on a share of the cores."""
        try:
            yield self.enter()
        finally:
            self.leave()
