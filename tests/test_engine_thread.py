"""The engine thread: jobs take turns with decode steps, and never wait forever."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

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
    engine = CountingEngine()
    thread = EngineThread("w", engine)
    thread.run(lambda: engine.add(["long", 10**12]))  # something is decoding, for good
    futures = [thread.submit(lambda: engine.steps) for _ in range(20)]  # all queued at once
    seen = [f.result(timeout=30) for f in futures]
    # A step ran between every two jobs: queued together, they still never run in one go.
    assert all(b > a for a, b in itertools.pairwise(seen)), seen
    with pytest.raises(ZeroDivisionError):  # a job's error reaches its caller
        thread.run(lambda: 1 / 0)
    thread.run(engine.running.clear)
    thread.shutdown(timeout=10)
    with pytest.raises(RuntimeError, match=r"shutting down|stopped"):
        thread.run(lambda: 1)
