"""engine/heap.py: the malloc arena limit and the trims that give freed heap memory back (issue
42), against a stand-in libc (what is called, with what) and against the real glibc where the
machine has it."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine import heap
from engine.session_store import SessionStore
from server.metrics import Metrics
from server.state import ServerSettings, ServerState


class FakeLibc:
    """malloc_trim, mallopt and mallinfo2 as glibc has them, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.trimmed = threading.Event()

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        self.trimmed.set()
        return 1

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def mallinfo2(self) -> heap._MallInfo2:
        return heap._MallInfo2(uordblks=3 << 20, hblkhd=5 << 20, fordblks=7 << 20)


def test_limit_arenas_sets_glibcs_arena_max():
    libc = FakeLibc()
    assert heap.limit_arenas(2, libc)
    assert libc.calls == [("mallopt", -8, 2)]  # M_ARENA_MAX, as malloc.h numbers it
    assert not heap.limit_arenas(0, libc)  # 0: glibc's own default, nothing set
    assert len(libc.calls) == 1


def test_a_trim_calls_malloc_trim_and_counts_it():
    libc = FakeLibc()
    trimmer = heap.HeapTrimmer(libc=libc)
    trimmer.trim()
    assert libc.calls == [("malloc_trim", 0)]  # 0: keep no padding at the heaps' tops
    assert trimmer.trims == 1 and trimmer.released_bytes >= 0


def test_in_use_counts_the_arenas_and_the_mmapped_blocks_not_the_free_chunks():
    assert heap.HeapTrimmer(libc=FakeLibc()).in_use_bytes() == 8 << 20


def test_without_glibc_nothing_runs_and_nothing_is_reported():
    trimmer = heap.HeapTrimmer(libc=None)
    assert not trimmer.active
    trimmer.start()
    assert trimmer._thread is None
    assert trimmer.trim() == 0 and trimmer.in_use_bytes() == 0
    metrics = Metrics()
    metrics.add_heap_metrics(trimmer)
    assert b"heap_in_use_bytes" not in metrics.render()


def test_metrics_report_the_heap_in_use_and_the_trims():
    trimmer = heap.HeapTrimmer(libc=FakeLibc())
    trimmer.trim()
    metrics = Metrics()
    metrics.add_heap_metrics(trimmer)
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples["cdlm_serve:heap_in_use_bytes"] == 8 << 20
    assert samples["cdlm_serve:heap_trims_total"] == 1


@pytest.mark.parametrize(("device", "active"), [("cpu", True), ("cuda", False)])
def test_the_server_trims_on_cpu_only(tmp_path, device, active):
    settings = ServerSettings(models=[], device=torch.device(device), dtype=torch.float32)
    state = ServerState(settings, SessionStore(tmp_path, 1 << 20))
    try:
        assert state.heap.every_s == (settings.heap_trim_seconds if active else 0)
    finally:
        state.compactions.shutdown()


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc only")
def test_the_real_glibc_sees_a_block_allocated_and_freed():
    trimmer = heap.HeapTrimmer()
    before = trimmer.in_use_bytes()
    block = bytearray(64 << 20)  # mmapped by malloc: counted in use until freed
    assert trimmer.in_use_bytes() - before >= 60 << 20
    del block
    assert trimmer.in_use_bytes() - before < 32 << 20
    trimmer.trim()
    assert trimmer.trims == 1


def test_a_big_free_wakes_the_running_trimmer_before_its_period():
    """heap.freed (what the engine and the routes call) reaches the trimmer that runs, and
    only while it runs."""
    libc = FakeLibc()
    trimmer = heap.HeapTrimmer(every_s=3600, soon_s=0, libc=libc)  # no periodic trim here
    heap.freed(1 << 40)  # none running: nothing to wake
    trimmer.start()
    try:
        heap.freed(trimmer.big_bytes)
        assert libc.trimmed.wait(30), "a big free did not trigger a trim"
    finally:
        trimmer.stop()
    assert libc.calls == [("malloc_trim", 0)] and heap._running is None


def test_an_idle_ar_engine_reports_the_batch_cache_it_drops(tmp_path, monkeypatch):
    """The grown batch cache of a long prompt is released once idle, and said to be freed
    (with its size), so the trimmer gives the memory back."""
    import tiny_models
    from engine.ar_engine import AREngine
    from engine.sampling import SamplingParams
    from models.loading import load_model

    tiny_models.hf_tiny("llama", tmp_path)
    model, _ = load_model(tmp_path)
    engine = AREngine(model, tiny_models.byte_tokenizer(), max_model_len=512)
    reported: list[int] = []
    monkeypatch.setattr(heap, "freed", reported.append)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    grown: list[int] = []
    sequence = engine.new_sequence("long", list(range(300)), greedy)  # past the first size
    engine.add(sequence)
    while engine.has_work():
        if engine.cache is not None:
            grown.append(engine.cache.allocated_bytes())
        engine.step()
    assert engine.cache is None and reported == [grown[-1]] and grown[-1] > 0
