"""Hand the heap's freed memory back to the OS on glibc (Linux), where PyTorch's CPU tensors
live: its CPU allocator is plain malloc.

Why: glibc keeps what is freed in its arenas (one per thread that allocated, up to 8 per
core) and gives back only the top of each heap. A server's big frees (a step's activations,
a session's cache once deleted or compacted, a batch cache grown and dropped) land in the
middle of those heaps, so RSS keeps the high-water mark of every arena and creeps up as
different threads peak at different times. Measured with bench/soak.py on the default
models: `malloc_trim(0)` on a server soaked 6 minutes took its RSS from 1,552 MB to 1,383 MB
(docs/deploy.md has the comparison with jemalloc and MALLOC_ARENA_MAX).

`malloc_trim(0)` releases the free pages inside every arena (madvise), not just the tops;
it locks one arena at a time while it walks it, a few milliseconds, so it runs from its own
thread, every `every_s` seconds, and sooner after a big free is reported (`freed`). Not on
CUDA: device memory is the caching allocator's, and the host side stays small there.

`mallinfo2` gives what the heap holds in use (`in_use_bytes`): set against RSS, it tells a
leak (in use grows) from memory the allocator keeps (RSS grows, in use does not).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33: struct mallinfo2, every field a size_t (mallinfo's are int: they wrap).
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # non-mmapped bytes taken from the OS (all arenas)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmapped chunks (large blocks; given back when freed)
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use in the arenas
            "fordblks",  # bytes free in the arenas (kept, or trimmed to no pages)
            "keepcost",
        )
    ]


def _glibc() -> ctypes.CDLL | None:
    """libc, if this is glibc on Linux with malloc_trim and mallinfo2; None anywhere else
    (musl, macOS, jemalloc or mimalloc preloaded: their own malloc returns memory itself)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    info.argtypes, info.restype = [], _MallInfo2
    if _preloaded_allocator():
        return None
    return libc


def _preloaded_allocator() -> bool:
    """A malloc other than glibc's is in use (LD_PRELOAD=libjemalloc...): trimming glibc's
    empty arenas would do nothing."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return False
    return any(name in maps for name in ("libjemalloc", "libmimalloc", "libtcmalloc"))


_running: HeapTrimmer | None = None  # the server's, once started


def freed(nbytes: int) -> None:
    """Code that just dropped `nbytes` of tensors (a batch cache, a session's cache) says so:
    the running trimmer, if any, trims soon when that is a lot. The engine and the routes call
    this without holding a trimmer: there is one per process."""
    if _running is not None:
        _running.freed(nbytes)


M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def limit_arenas(n: int, libc: ctypes.CDLL | None = None) -> bool:
    """At most `n` malloc arenas for the threads started from now on (glibc's default is 8 per
    core, each keeping its own high-water mark); True if set. Call it before the server starts
    its threads: those that already have an arena keep it."""
    libc = libc or _glibc()
    return libc is not None and n > 0 and libc.mallopt(M_ARENA_MAX, n) == 1


@dataclass
class HeapTrimmer:
    """Calls malloc_trim(0) every `every_s` seconds, and `soon_s` after a big free is
    reported; counts its trims and the RSS they gave back."""

    every_s: float = 60.0
    soon_s: float = 1.0  # a reported free waits this long: the frees around it come too
    big_bytes: int = 32 << 20  # frees reported below this wait for the periodic trim
    libc: ctypes.CDLL | None = field(default_factory=_glibc)
    trims: int = 0
    released_bytes: int = 0  # RSS given back, summed over trims (as /proc saw it)
    _wake: threading.Event = field(default_factory=threading.Event)
    _halt: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.libc is not None and self.every_s > 0

    def start(self) -> None:
        """Trim from now on; `freed` (this module's) reports to this trimmer."""
        global _running
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)
            self._thread.start()
            _running = self

    def stop(self) -> None:
        global _running
        if _running is self:
            _running = None
        self._halt.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def freed(self, nbytes: int) -> None:
        """`nbytes` were just freed (a cache dropped): trim soon if that is a lot."""
        if nbytes >= self.big_bytes:
            self._wake.set()

    def trim(self) -> int:
        """Trim now; the RSS bytes it gave back (0 where there is nothing to trim)."""
        if self.libc is None:
            return 0
        before = _rss_bytes()
        self.libc.malloc_trim(0)
        released = max(0, before - _rss_bytes())
        self.trims += 1
        self.released_bytes += released
        return released

    def in_use_bytes(self) -> int:
        """Bytes the program holds through malloc (arenas and mmapped blocks); 0 off glibc."""
        if self.libc is None:
            return 0
        info = self.libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def _run(self) -> None:
        while not self._halt.is_set():
            if self._wake.wait(self.every_s):
                self._wake.clear()
                self._halt.wait(self.soon_s)
            if not self._halt.is_set():
                started = time.perf_counter()
                released = self.trim()
                log.debug(
                    "malloc_trim gave back %.1f MB in %.1f ms",
                    released / 2**20,
                    1000 * (time.perf_counter() - started),
                )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:  # Linux only, as is glibc here
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
