"""The CPU cores, shared among the threads that have model work right now.

Each served model has an engine thread, and a compaction fits on a thread of its own; each
would use every core (torch's intra-op threads, an OpenMP team) if left alone. GNU OpenMP
(libgomp, which torch's CPU wheels use) keeps a pool of worker threads for every thread that
ever ran a team of more than one, and once its pools hold more threads than there are cores it
stops spinning before a worker sleeps (its "throttled" spin count, at most 1,000 rounds
whatever GOMP_SPINCOUNT says), so every parallel region then waits for sleeping workers to
wake. Measured here (2 cores, torch 2.13): a 264-wide softmax on 64 rows took 7.8 us on a
thread whose team was the only one, 43-51 us once a second thread had run a team of two;
the shipped student's 40-token fused step 1.6 ms vs 6.8 ms. The old split (each busy thread
on cores // busy threads of its own) made every thread a team owner, so a server that had
run both models once ran every later step at the throttled speed (DLM alone 315 tok/s on a
fresh server, 118 after the AR model had been busy).

So exactly one thread here ever runs OpenMP teams: the *wide* thread, which sets its count
once when it starts. Every other thread defaults to one intra-op thread
(`torch.set_num_threads(1)` when the share is made, after the wide thread has its count: torch
hands that default to threads that have not run an op yet, for its own loops) and says so once
more itself before its first piece of work (MKL's matmuls and solvers keep their own count per
thread, all cores unless told: a compaction's fits beside a busy engine started a second team
that way). Nothing else in the process may call `torch.set_num_threads`: it would change the
default of every thread made after it.

A piece of model work goes through `run`: when its thread is the only busy one, or when each
busy thread would get two cores or more, it runs on the wide thread on every core, one piece at
a time in arrival order (busy threads take turns: fair by pieces); when the cores are fewer
than two per busy thread (two models busy on two cores), it runs right there on one core,
beside the others.
Measured (2 cores, one process, each alone on both cores vs both busy on one core each):
softmax 12.8 us per thread on one core each vs 7.8 us alone, 1.6x the throughput of taking
turns.

A thread says when it has no work for now (`leave`, before it waits); `enter` marks it busy.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# The machine's cores, as torch counts them at import (OMP_NUM_THREADS, or every core): what a
# share splits, even after a share has set this process's default to one thread.
MACHINE_CORES = torch.get_num_threads()


def _loaded(name: str) -> list[str]:
    """Paths of the shared libraries loaded in this process whose file name contains `name`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if name in line.split()[-1]})


def _this_thread_setter() -> Callable[[int], None] | None:
    """A function that sets the calling thread's OpenMP and MKL thread counts without touching
    torch's process default (`torch.set_num_threads` sets both), or None where the runtimes'
    entry points are not found (then the wide thread uses torch.set_num_threads)."""
    omp = None
    # torch's own OpenMP runtime, the one its parallel loops (and the fused kernels', which
    # resolve libgomp.so.1 to the copy torch loaded) read: looked up through libtorch_cpu,
    # whose dependencies dlsym searches first. Other packages bring OpenMP runtimes of their
    # own (sentencepiece's wheel ships a libgomp, loaded whenever transformers imports it),
    # and setting one of those left the wide thread on one core after its first step.
    for path in _loaded("libtorch_cpu") + _loaded("libgomp") + _loaded("libiomp"):
        with contextlib.suppress(OSError, AttributeError):
            omp = ctypes.CDLL(path).omp_set_num_threads
            break
    if omp is None:
        return None
    mkl = None
    for path in _loaded("libtorch_cpu"):
        with contextlib.suppress(OSError, AttributeError):
            # The C entry point (the lowercase names are Fortran's, taking a pointer).
            mkl = ctypes.CDLL(path).MKL_Set_Num_Threads_Local

    def set_here(threads: int) -> None:
        omp(ctypes.c_int(threads))
        if mkl is not None:
            mkl(ctypes.c_int(threads))

    return set_here


class _WideThread:
    """The one thread that runs OpenMP teams of more than one thread: runs callables in
    arrival order on `threads` intra-op threads, for the threads that hand them over."""

    def __init__(self, threads: int) -> None:
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._threads = threads
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(ready,), name="cores-wide", daemon=True
        )
        self.thread.start()
        ready.wait()

    def call(self, fn: Callable[[], T]) -> T:
        done: Future[T] = Future()
        self._inbox.put((fn, done))
        return done.result()  # re-raises what fn raised, with its traceback

    def _run(self, ready: threading.Event) -> None:
        # At the start: the count is this thread's from now on (OpenMP's and MKL's are per
        # thread); the process default torch.set_num_threads also sets is put back by the
        # share. torch sets a thread's count from that default once per library at the
        # thread's first parallel op there (the fused kernels' extension has its own copy of
        # that check, and reset this thread to one core that way): each piece checks, and
        # puts the count back for this thread alone.
        torch.get_num_threads()
        torch.set_num_threads(self._threads)
        set_here = _this_thread_setter()
        ready.set()
        while True:
            # The piece is a call's argument, not a local of this loop: it is let go of on
            # return. A loop variable stayed alive while the thread waited for its next piece,
            # which can take minutes (it only gets pieces while one thread has work), and with
            # it the piece's closure and result: a compaction's staged forward held its
            # working copy of the session's cache, ~80 MB on SmolLM2 at 1.5K tokens, long
            # after the compaction, even after the session's delete (issue 42's soak).
            self._serve(*self._inbox.get(), set_here)

    def _serve(
        self, fn: Callable[[], Any], done: Future[Any], set_here: Callable[[int], None] | None
    ) -> None:
        if torch.get_num_threads() != self._threads and set_here is not None:
            set_here(self._threads)
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn())
        except BaseException as e:  # handed to the caller
            done.set_exception(e)


class CoreShare:
    """One per process (`shared()`): every model's engine thread and the compaction thread
    share it. Making one sets this process's default to one intra-op thread (see the module's
    doc); two in one process would make two wide threads, two team owners."""

    _shared: CoreShare | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> CoreShare:
        """The process's share of every core, made on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self, cores: int | None = None):
        self.cores = cores or MACHINE_CORES
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._wide = _WideThread(self.cores) if self.cores > 1 else None
        self._local = threading.local()
        # After the wide thread has its count: torch.set_num_threads also sets the default of
        # threads that have not run an op yet, and theirs must be one.
        torch.set_num_threads(1)

    @property
    def busy(self) -> int:
        return len(self._busy)

    def enter(self) -> int:
        """The calling thread has work: it counts as busy until it `leave`s. Returns how many
        cores each busy thread gets now."""
        with self._lock:
            self._busy.add(threading.get_ident())
            return max(1, self.cores // len(self._busy))

    def leave(self) -> None:
        """The calling thread has no work for now (it is about to wait)."""
        with self._lock:
            self._busy.discard(threading.get_ident())

    def run(self, fn: Callable[[], T]) -> T:
        """Run one piece of model work for the calling thread (which counts as busy from now
        on): on the wide thread on every core, waiting for its turn, where each busy thread's
        share is two cores or more; else right here on one core."""
        if self._wide is not None and threading.current_thread() is self._wide.thread:
            return fn()  # already on the wide thread: a piece inside a piece
        if self.enter() >= 2 and self._wide is not None:
            return self._wide.call(fn)
        if not getattr(self._local, "single", False):
            # Said once per thread, out loud: torch's inherited default of one thread covers
            # its own parallel loops but not MKL's, whose matmuls and solvers would otherwise
            # start a team of every core here (measured: that too makes the wide thread slow).
            torch.set_num_threads(1)
            self._local.single = True
        return fn()

    @contextmanager
    def working(self) -> Iterator[None]:
        """Busy for the length of the block (a compaction's fits, each piece through `run`)."""
        try:
            self.enter()
            yield
        finally:
            self.leave()
