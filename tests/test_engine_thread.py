"""The engine thread: jobs take turns with decode steps, and never wait forever."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import shutil
import threading
import time
import weakref
from dataclasses import dataclass

import pytest
import torch

from cdlm_serve.engine import core_share
from cdlm_serve.engine.core_share import CoreShare
from cdlm_serve.engine.decoding import Priority, WorkQueue
from cdlm_serve.engine.engine_thread import EngineThread


@dataclass
class Out:
    request_id: str
    finish_reason: str | None


class CountingEngine:
    """A batching engine whose sequences each take `length` steps (enough to see ordering)."""

    def __init__(self) -> None:
        self.steps = 0
        self.running: list[list] = []
        self.work = WorkQueue()

    def add(self, seq) -> None:
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.running)

    def num_waiting(self) -> int:
        return 0

    def num_running(self) -> int:
        return len(self.running)

    def kv_usage(self) -> float:
        return 0.0

    def kv_bytes(self) -> int:
        return 0

    def release_idle(self) -> None:
        assert not self.running, "released with a sequence still running"
        self.releases = getattr(self, "releases", 0) + 1

    def reset(self) -> None:
        self.running.clear()

    def step(self) -> list[Out]:
        self.steps += 1
        outs = []
        for seq in list(self.running):
            seq[1] -= 1
            done = seq[1] == 0
            outs.append(Out(seq[0], "length" if done else None))
            if done:
                self.running.remove(seq)
        return outs


def test_jobs_take_turns_with_decode_steps():
    engine = TimedEngine(0.002)
    thread = EngineThread("w", engine)
    thread.run(lambda: engine.add(["long", 10**12]))  # something is decoding, for good

    def job() -> int:
        time.sleep(0.01)  # longer than a step: its turn is used up by one job
        return engine.steps

    futures = [thread.submit(job) for _ in range(20)]  # all queued at once
    seen = [f.result(timeout=30) for f in futures]
    # A step ran between every two jobs: queued together, they still never run in one go.
    assert all(b > a for a, b in itertools.pairwise(seen)), seen
    with pytest.raises(ZeroDivisionError):  # a job's error reaches its caller
        thread.run(lambda: 1 / 0)
    thread.run(engine.running.clear)
    thread.shutdown(timeout=10)
    with pytest.raises(RuntimeError, match=r"shutting down|stopped"):
        thread.run(lambda: 1)


def test_an_idle_engine_releases_its_caches_once_a_spell_after_its_release_time():
    """The engine thread asks the engine to let go of its batch caches once it has been idle
    `idle_release_s` in a row: not while anything runs, not again in the same idle spell, and
    again in the next one."""
    engine = CountingEngine()
    thread = EngineThread("w", engine, idle_release_s=2.0)
    try:
        thread.run(lambda: engine.add(["a", 3]))  # ends its idle spell; 3 steps of work
        time.sleep(1.0)
        assert getattr(engine, "releases", 0) == 0  # idle, but not for long enough
        deadline = time.monotonic() + 10
        while getattr(engine, "releases", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.releases == 1
        time.sleep(3.0)  # the same spell goes on: no second release
        assert engine.releases == 1
        thread.run(lambda: engine.add(["b", 2]))  # a new spell after this one
        time.sleep(1.2)  # idle again, but not for the release time since "b"
        assert engine.releases == 1
        deadline = time.monotonic() + 10
        while engine.releases == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.releases == 2 and engine.steps == 5
    finally:
        thread.shutdown(timeout=10)


class TimedEngine(CountingEngine):
    """Each step takes `seconds` (asleep: no CPU) and records when it ran and on how many
    torch threads."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.spans: list[tuple[float, float]] = []
        self.threads: list[int] = []

    def step(self) -> list[Out]:
        started = time.perf_counter()
        self.threads.append(torch.get_num_threads())
        time.sleep(self.seconds)
        self.spans.append((started, time.perf_counter()))
        return super().step()


@pytest.mark.parametrize("priority", [Priority.REQUEST, Priority.BACKGROUND])
def test_short_jobs_get_their_prioritys_share_of_a_steps_time_between_two_steps(priority):
    """A long piece of work cut into short jobs, each submitted when the last one's result is
    back (as a compaction does): between two steps they run for their priority's share of a
    step's time (a request's: as long as a step; background work: half as long), so the work
    gets about half (a third of) the thread instead of one short job per step; and never much
    more."""
    engine = TimedEngine(0.03)
    thread = EngineThread("w", engine)
    thread.run(lambda: engine.add(["long", 10**12]))
    _until(lambda: engine.steps >= 3)
    ran: list[tuple[float, float, int]] = []

    def job() -> None:
        started = time.perf_counter()
        time.sleep(0.002)
        ran.append((started, time.perf_counter(), engine.steps))

    for _ in range(60):
        thread.run(job, priority)
    turns = {steps for *_, steps in ran}
    assert len(turns) <= 60 / 4  # several jobs per turn (one job per step would be 60 turns)
    share = {Priority.REQUEST: 0.03, Priority.BACKGROUND: 0.015}[priority]
    for turn in turns:  # a turn's jobs stop once they had their share, plus one job at most
        spans = [(a, b) for a, b, steps in ran if steps == turn]
        assert sum(b - a for a, b in spans) <= share + 0.004 + 0.006  # share, one job, slack
    thread.run(engine.running.clear)
    thread.shutdown(timeout=10)


def test_queued_work_runs_in_priority_order():
    engine = TimedEngine(0.01)
    thread = EngineThread("w", engine)
    thread.run(lambda: engine.add(["long", 10**12]))
    gate = threading.Event()
    order: list[str] = []
    held = thread.submit(gate.wait)  # holds the thread: the next ones queue up behind it
    _until(held.running)
    later = [
        thread.submit(lambda: order.append("background 1"), Priority.BACKGROUND),
        thread.submit(lambda: order.append("request"), Priority.REQUEST),
        thread.submit(lambda: order.append("background 2"), Priority.BACKGROUND),
    ]
    time.sleep(0.05)
    gate.set()
    for f in later:
        f.result(timeout=30)
    assert order == ["request", "background 1", "background 2"]
    thread.run(engine.running.clear)
    thread.shutdown(timeout=10)


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class WhereEngine(TimedEngine):
    """A TimedEngine that also records which thread ran each step."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.where: list[str] = []

    def step(self) -> list[Out]:
        self.where.append(threading.current_thread().name)
        return super().step()


def _teams(*engines: WhereEngine) -> set[str]:
    """The threads that ran a step on more than one intra-op thread."""
    return {w for e in engines for w, n in zip(e.where, e.threads, strict=False) if n > 1}


def test_one_busy_engine_gets_every_core_and_two_split_them_on_two_cores():
    """Alone, an engine's steps run on the share's wide thread on every core; with two busy on
    two cores each runs on its own thread on one core; once the other is idle, every core
    again. Only the wide thread ever runs a team of more than one thread (see
    engine/core_share.py: a second team owner slows every parallel region)."""
    before = torch.get_num_threads()
    cores = CoreShare(2)
    a_engine, b_engine = WhereEngine(0.002), WhereEngine(0.002)
    a = EngineThread("a", a_engine, cores=cores)
    b = EngineThread("b", b_engine, cores=cores)
    try:
        a.run(lambda: a_engine.add(["a", 10**12]))
        _until(lambda: len(a_engine.threads) > 3)
        assert (a_engine.threads[-1], a_engine.where[-1]) == (2, "cores-wide")  # alone
        b.run(lambda: b_engine.add(["b", 10**12]))
        steps = len(a_engine.threads)
        _until(lambda: len(a_engine.threads) > steps + 3 and len(b_engine.threads) > 3)
        assert (a_engine.threads[-1], a_engine.where[-1]) == (1, "batch-a")  # both busy
        assert (b_engine.threads[-1], b_engine.where[-1]) == (1, "batch-b")
        b.run(b_engine.running.clear)  # b is idle again: a gets every core back
        _until(lambda: cores.busy == 1)
        steps = len(a_engine.threads)
        _until(lambda: len(a_engine.threads) > steps + 3)
        assert (a_engine.threads[-1], a_engine.where[-1]) == (2, "cores-wide")
        a.run(a_engine.running.clear)
        _until(lambda: cores.busy == 0)
    finally:
        a.shutdown(timeout=10)
        b.shutdown(timeout=10)
    assert _teams(a_engine, b_engine) == {"cores-wide"}
    assert torch.get_num_threads() == 1  # a share makes one thread the default elsewhere
    torch.set_num_threads(before)


def test_with_two_cores_or_more_each_busy_engines_take_turns_on_the_wide_thread():
    cores = CoreShare(4)
    a_engine, b_engine = WhereEngine(0.002), WhereEngine(0.002)
    a = EngineThread("a", a_engine, cores=cores)
    b = EngineThread("b", b_engine, cores=cores)
    before = torch.get_num_threads()
    try:
        a.run(lambda: a_engine.add(["a", 10**12]))
        b.run(lambda: b_engine.add(["b", 10**12]))
        _until(lambda: cores.busy == 2)
        steps = len(a_engine.spans), len(b_engine.spans)
        _until(lambda: len(a_engine.spans) > steps[0] + 5 and len(b_engine.spans) > steps[1] + 5)
        a.run(a_engine.running.clear)
        b.run(b_engine.running.clear)
    finally:
        a.shutdown(timeout=10)
        b.shutdown(timeout=10)
    both = [s for e in (a_engine, b_engine) for s in e.spans[steps[0 if e is a_engine else 1] :]]
    assert a_engine.where[-1] == b_engine.where[-1] == "cores-wide"
    assert a_engine.threads[-1] == b_engine.threads[-1] == 4
    # One piece at a time on the wide thread: no two steps overlap.
    both.sort()
    assert all(x[1] <= y[0] for x, y in itertools.pairwise(both))
    torch.set_num_threads(before)


def test_a_compaction_fits_beside_the_engine_on_a_share_of_the_cores():
    from cdlm_serve.engine.compaction import CompactionRuntime
    from cdlm_serve.server.compaction_thread import Compactions

    cores = CoreShare(2)
    engine = WhereEngine(0.05)
    thread = EngineThread("e", engine, cores=cores)
    compactions = Compactions(cores)
    seen: dict[str, object] = {}

    def fit(runtime: CompactionRuntime) -> None:
        on_engine, on_fit = runtime.on_engine, runtime.on_fit
        seen["alone"] = on_fit(lambda: (torch.get_num_threads(), threading.current_thread().name))
        thread.run(lambda: engine.add(["decoding", 10**12]))
        _until(lambda: len(engine.threads) > 0)  # the engine is decoding, beside this fit
        seen["beside a step"] = on_fit(torch.get_num_threads)
        # While its model work runs on the engine thread, the fit does not count.
        seen["busy during a piece"] = on_engine(lambda: cores.busy)
        thread.run(engine.running.clear)

    try:
        asyncio.run(compactions.run(fit, CompactionRuntime(on_engine=thread.run)))
    finally:
        compactions.shutdown()
        thread.shutdown(timeout=10)
    assert seen == {"alone": (2, "cores-wide"), "beside a step": 1, "busy during a piece": 1}
    assert 1 in engine.threads  # the engine's steps beside the fit ran on one core too


def test_the_wide_thread_lets_go_of_a_piece_and_its_result_once_handed_over():
    """The wide thread waits for its next piece for as long as several threads are busy (it
    only gets pieces while one thread has the cores): minutes under a mixed load. Meanwhile it
    must hold nothing of its last piece (issue 42: a compaction's staged forward, and with it
    its working copy of a session's cache, ~80 MB, stayed alive that long)."""
    before = torch.get_num_threads()
    cores = CoreShare(2)

    class Held:
        """Stands for what a piece's closure and its result hold (a cache, a tensor)."""

    captured, returned = Held(), Held()
    alive = [weakref.ref(captured), weakref.ref(returned)]

    def piece(held: Held = captured, out: Held = returned) -> tuple[Held, str]:
        return out, threading.current_thread().name

    try:
        result, where = cores.run(piece)  # the only busy thread here: on the wide thread
        cores.leave()
        assert where == "cores-wide" and result is returned
        del captured, returned, result, piece
        _until(lambda: all(ref() is None for ref in alive), timeout=5)
    finally:
        torch.set_num_threads(before)


def test_the_wide_threads_count_is_set_in_torchs_own_openmp_runtime(tmp_path, monkeypatch):
    """Other packages bring OpenMP runtimes of their own (sentencepiece's wheel ships a
    libgomp, loaded whenever transformers imports it). The share must set the count in the one
    torch's loops read: setting another left the wide thread on one core after its first
    fused step, so a server with sentencepiece installed decoded on 1 of 2 cores (c=16: 443
    tok/s, 732 after the fix). A copy of a loaded libgomp is such a runtime, listed first."""
    loaded = core_share._loaded("libgomp")
    assert loaded, "torch's CPU wheel loads its libgomp"
    decoy = tmp_path / "libgomp-decoy.so.1"
    shutil.copy(loaded[0], decoy)
    ctypes.CDLL(str(decoy))  # a second runtime in the process, as sentencepiece's is
    real = core_share._loaded
    monkeypatch.setattr(
        core_share, "_loaded", lambda name: ([str(decoy)] if name == "libgomp" else []) + real(name)
    )
    set_here = core_share._this_thread_setter()
    assert set_here is not None
    seen: list[int] = []

    def probe() -> None:
        torch.get_num_threads()  # this thread's count, first set from the process default
        for n in (1, 3, 2):
            set_here(n)
            seen.append(torch.get_num_threads())

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    assert seen == [1, 3, 2]


def test_the_wide_thread_keeps_every_core_after_fused_steps_beside_another_openmp(
    tmp_path, monkeypatch
):
    """The failure the setter test above guards, end to end: the fused kernels' extension
    resets a thread's count to the process default (one, under a share) at its first parallel
    op there, and the share puts it back before each piece. With another libgomp listed first
    it put back the wrong runtime's, so every piece after the first ran on one core."""
    from cdlm_serve.models import kernels
    from cpu_features import skip_unless

    skip_unless("avx2", kernels.enable_cpu_kernels(), "the fused CPU kernels")
    decoy = tmp_path / "libgomp-decoy.so.1"
    shutil.copy(core_share._loaded("libgomp")[0], decoy)
    ctypes.CDLL(str(decoy))
    real = core_share._loaded
    monkeypatch.setattr(
        core_share, "_loaded", lambda name: ([str(decoy)] if name == "libgomp" else []) + real(name)
    )
    before = torch.get_num_threads()
    cores = CoreShare(2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    w = torch.randn(96, 64).to(torch.bfloat16)

    def fused_piece() -> int:
        counts = torch.get_num_threads()
        kernels._kernel.linear_bf16(x, w, None)  # the extension's first parallel op here
        return counts

    seen = []
    worker = threading.Thread(target=lambda: seen.extend(cores.run(fused_piece) for _ in range(4)))
    try:
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 2, 2]  # the count each piece started with, on the wide thread
