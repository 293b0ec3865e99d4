"""The row scheduler both engines share (engine/decoding/scheduler.py), on plain sequences:
admission per group, the abort sweep, retiring with row moves."""

from __future__ import annotations

from dataclasses import dataclass

from cdlm_serve.engine.decoding.interface import EngineOutput
from cdlm_serve.engine.decoding.scheduler import Scheduler


@dataclass(eq=False)
class Seq:
    id: str
    kind: str = "a"
    row: int = -1
    finish_reason: str | None = None
    admitted: float | None = None
    gone: bool = False

    def aborted(self) -> bool:
        return self.gone


def _scheduler(max_batch: int = 2):
    log: list[tuple] = []
    sched: Scheduler[Seq] = Scheduler(
        max_batch,
        group_of=lambda s: s.kind,
        abort_output=lambda s: EngineOutput(s.id, [], "", "abort"),
        move_row=lambda group, src, dst: log.append(("move", group, src, dst)),
        release=lambda s: log.append(("release", s.id, s.row)),
    )
    sched.on_finish = lambda s: log.append(("finish", s.id))
    return sched, log


def test_groups_fill_in_arrival_order_and_a_full_one_holds_back_no_other():
    sched, _ = _scheduler(max_batch=2)
    seqs = [Seq("a1"), Seq("a2"), Seq("a3"), Seq("b1", "b")]
    for s in seqs:
        sched.add(s)
    joined = sched.schedule([])
    assert {g: [s.id for s in v] for g, v in joined.items()} == {"a": ["a1", "a2"], "b": ["b1"]}
    assert [s.row for s in seqs] == [0, 1, -1, 0]
    assert all(s.admitted is not None for s in seqs if s.row >= 0)
    assert [s.id for s in sched.waiting] == ["a3"]
    assert sched.num_running() == 3 and sched.num_waiting() == 1


def test_a_finished_row_is_refilled_by_the_last_and_the_waiting_join():
    sched, log = _scheduler(max_batch=3)
    a, b, c, d = (Seq(x) for x in "abcd")
    for s in (a, b, c, d):
        sched.add(s)
    sched.schedule([])
    a.finish_reason = "stop"
    sched.retire_finished()
    # a's work is released while it still holds row 0, then c (the last row) moves into it.
    assert log == [("release", "a", 0), ("move", "a", 2, 0), ("finish", "a")]
    assert sched.group("a") == [c, b] and (c.row, b.row) == (0, 1)
    joined = sched.schedule([])
    assert joined == {"a": [d]} and d.row == 2


def test_aborted_sequences_leave_running_or_waiting():
    sched, log = _scheduler(max_batch=1)
    run, wait = Seq("run"), Seq("wait")
    sched.add(run)
    sched.add(wait)
    sched.schedule([])
    assert sched.waiting == [wait]
    run.gone = wait.gone = True
    outputs: list[EngineOutput] = []
    joined = sched.schedule(outputs)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("run", "abort"),
        ("wait", "abort"),
    ]
    assert joined == {} and not sched.has_work()
    assert ("finish", "run") in log and ("finish", "wait") in log
    assert wait.row == -1 and wait.admitted is None  # never admitted, nothing to release
    assert ("release", "wait", -1) not in log


def test_rows_finishing_in_the_same_step_all_leave():
    """Two rows finish in one step, the first and the last: retiring the first moves the last
    into its row, and the moved one must still be retired (a sweep over the live group skips
    it: that request then ran another step and sent a second finish)."""
    sched, log = _scheduler(max_batch=4)
    a, b, c, d = (Seq(x) for x in "abcd")
    for s in (a, b, c, d):
        sched.add(s)
    sched.schedule([])
    a.finish_reason = d.finish_reason = "length"
    sched.retire_finished()
    assert sched.group("a") == [c, b] and (c.row, b.row) == (0, 1)
    assert [e for e in log if e[0] == "finish"] == [("finish", "a"), ("finish", "d")]
    assert [e for e in log if e[0] == "release"] == [("release", "a", 0), ("release", "d", 0)]


def test_aborting_rows_that_are_not_the_last_keeps_the_others_rows_straight():
    """The first and the last of four rows abort in one sweep: both leave with one output
    each, and the rows left are 0..n-1, each sequence at its own index."""
    sched, log = _scheduler(max_batch=4)
    a, b, c, d = (Seq(x) for x in "abcd")
    for s in (a, b, c, d):
        sched.add(s)
    sched.schedule([])
    a.gone = d.gone = True
    outputs: list[EngineOutput] = []
    sched.schedule(outputs)
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        ("a", "abort"),
        ("d", "abort"),
    ]
    assert sched.group("a") == [c, b] and (c.row, b.row) == (0, 1)
    assert sorted(e[1] for e in log if e[0] == "finish") == ["a", "d"]
