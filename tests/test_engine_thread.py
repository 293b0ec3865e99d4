"""The engine thread: jobs take turns with decode steps, and never wait forever."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import pytest
import torch

from engine.core_share import CoreShare
from engine.engine_thread import EngineThread


@dataclass
class Out:
    request_id: str
    finish_reason: str | None


class CountingEngine:
    """A batching engine whose sequences each take `length` steps (enough to see ordering)."""

    def __init__(self) -> None:
        self.steps = 0
        self.running: list[list] = []

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


def test_short_jobs_get_as_much_time_between_two_steps_as_a_step_takes():
    """A long piece of work cut into short jobs, each submitted when the last one's result is
    back (as a compaction does): between two steps they run for about a step's time, so the
    work gets about half the thread instead of one short job per step; and never much more."""
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
        thread.run(job)
    turns = {steps for *_, steps in ran}
    assert len(turns) <= 60 / 4  # several jobs per turn (one job per step would be 60 turns)
    for turn in turns:  # a turn's jobs stop once they had a step's time, plus one job at most
        spans = [(a, b) for a, b, steps in ran if steps == turn]
        assert sum(b - a for a, b in spans) <= 0.03 + 0.02 + 0.01  # step, one job, slack
    thread.run(engine.running.clear)
    thread.shutdown(timeout=10)


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_busy_engine_threads_split_the_cores_and_an_idle_one_gives_its_share_back():
    before = torch.get_num_threads()
    cores = CoreShare(4)
    a_engine, b_engine = TimedEngine(0.002), TimedEngine(0.002)
    a = EngineThread("a", a_engine, cores=cores)
    b = EngineThread("b", b_engine, cores=cores)
    try:
        a.run(lambda: a_engine.add(["a", 10**12]))
        _until(lambda: len(a_engine.threads) > 3)
        assert a_engine.threads[-1] == 4  # alone: every core
        b.run(lambda: b_engine.add(["b", 10**12]))
        assert b.run(torch.get_num_threads) == 2  # both busy: half each
        steps = len(a_engine.threads)
        _until(lambda: len(a_engine.threads) > steps + 3)
        assert a_engine.threads[-1] == 2 and b_engine.threads[-1] == 2
        b.run(b_engine.running.clear)  # b is idle again: a gets its cores back
        _until(lambda: cores.busy == 1)
        steps = len(a_engine.threads)
        _until(lambda: len(a_engine.threads) > steps + 3)
        assert a_engine.threads[-1] == 4
        a.run(a_engine.running.clear)
        _until(lambda: cores.busy == 0)
    finally:
        a.shutdown(timeout=10)
        b.shutdown(timeout=10)
    assert torch.get_num_threads() == before  # set per thread: the caller's is untouched


def test_a_compaction_fits_beside_the_engine_on_a_share_of_the_cores():
    from server.sessions_api import Compactions

    cores = CoreShare(2)
    engine = TimedEngine(0.05)
    thread = EngineThread("e", engine, cores=cores)
    compactions = Compactions(cores)
    seen: dict[str, int] = {}

    def fit(on_engine) -> None:
        seen["alone"] = torch.get_num_threads()
        thread.run(lambda: engine.add(["decoding", 10**12]))
        _until(lambda: len(engine.threads) > 0)  # the engine is decoding, beside this fit
        seen["beside a step"] = cores.enter()
        seen["threads"] = torch.get_num_threads()
        # While its model work runs on the engine thread, the fit does not count.
        seen["busy during a piece"] = on_engine(lambda: cores.busy)
        thread.run(engine.running.clear)

    try:
        asyncio.run(compactions.run(fit, on_engine=thread.run))
    finally:
        compactions.shutdown()
        thread.shutdown(timeout=10)
    assert seen == {"alone": 2, "beside a step": 1, "threads": 1, "busy during a piece": 1}
    assert 1 in engine.threads  # the engine's steps beside the fit ran on one core too
