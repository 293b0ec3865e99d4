"""engine/heap.py: the malloc arena limit and the trims that give freed heap memory back (issue
42), against a stand-in libc (what is called, with what) and against the real glibc where the
machine has it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cdlm_serve.engine import heap
from cdlm_serve.engine.sessions.store import SessionStore
from cdlm_serve.server.metrics import Metrics
from cdlm_serve.server.state import ServerSettings, ServerState


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


def test_a_trim_calls_malloc_trim_and_counts_what_it_gave_back(monkeypatch):
    """Each trim counts the RSS it gave back, as /proc saw it before and after; a trim after
    which RSS grew (another thread allocated meanwhile) gave back nothing, not a negative."""
    libc = FakeLibc()
    trimmer = heap.HeapTrimmer(libc=libc)
    rss = iter([100 << 20, 60 << 20, 70 << 20, 75 << 20])  # before/after, two trims
    monkeypatch.setattr(heap, "_rss_bytes", lambda: next(rss))
    assert trimmer.trim() == 40 << 20
    assert libc.calls == [("malloc_trim", 0)]  # 0: keep no padding at the heaps' tops
    assert trimmer.trim() == 0
    assert trimmer.trims == 2 and trimmer.released_bytes == 40 << 20


def test_only_a_big_free_wakes_the_trimmer():
    """A free below `big_bytes` waits for the periodic trim (frees are reported all the time:
    waking a trim, a few ms with an arena locked, for each would cost more than it gives)."""
    trimmer = heap.HeapTrimmer(big_bytes=32 << 20, libc=FakeLibc())  # not started: no thread
    trimmer.freed(0)
    trimmer.freed((32 << 20) - 1)
    assert not trimmer._wake.is_set()
    trimmer.freed(32 << 20)
    assert trimmer._wake.is_set()


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


# float32 GEMMs of the sizes a server runs (decode rows to a long prefill), then what malloc
# still holds: the script runs in a fresh process, as the server starts, with the server's
# package imported before torch.
_MKL_HELD = """
import cdlm_serve.server.cli
import torch
from cdlm_serve.engine import heap
torch.set_num_threads(2)
trimmer = heap.HeapTrimmer()
before = trimmer.in_use_bytes()
w = torch.randn(1536, 576)
for m in (1, 8, 64, 300, 1500, 3000):
    x = torch.randn(m, 576)
    for _ in range(3):
        (x @ w.T) @ w
del w, x
print(trimmer.in_use_bytes() - before)
"""


def _held_after_gemms(mkl_env: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    if mkl_env is not None:
        env["MKL_DISABLE_FAST_MM"] = mkl_env
    out = subprocess.run(
        [sys.executable, "-c", _MKL_HELD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc only")
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_the_server_keeps_no_mkl_gemm_buffers_after_its_float32_gemms():
    """The holder of a float32 server's idle excess (issue 59): MKL's memory manager. The
    server's package turns it off before torch loads MKL; with it on (an empty value keeps it,
    the control) the same GEMMs leave megabytes held, so this test sees what it guards."""
    assert _held_after_gemms(None) < 1 << 20
    assert _held_after_gemms("") > 4 << 20


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
    from cdlm_serve.engine.decoding.ar_engine import AREngine
    from cdlm_serve.engine.decoding.sampling import SamplingParams
    from cdlm_serve.models.loading import load_model

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


def _tiny_ar_engine(tmp_path):
    import tiny_models
    from cdlm_serve.engine.decoding.ar_engine import AREngine
    from cdlm_serve.models.loading import load_model

    tiny_models.hf_tiny("llama", tmp_path)
    model, _ = load_model(tmp_path)
    return AREngine(model, tiny_models.byte_tokenizer(), max_model_len=512)


def _tokens(engine, seqs: list) -> dict[str, list[int]]:
    """Add the sequences, step until nothing runs; each one's answer."""
    out: dict[str, list[int]] = {seq.id: [] for seq in seqs}
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def test_shrink_keeps_the_live_rows_slots_and_empties_the_rest():
    from cdlm_serve.models.kv_cache import KVCache

    cache = KVCache.allocate(2, 3, 2, 4, 64, "cpu", torch.float32)
    for t in [*cache.keys, *cache.values]:
        t.copy_(torch.randn(t.shape))
    cache.biases = [torch.randn(3, 2, 64) for _ in range(2)]
    cache.lengths, cache.logical = [10, 20, 50], [10, 90, 50]  # row 1 compacted
    before = [t.clone() for t in [*cache.keys, *cache.values, *cache.biases]]
    with pytest.raises(ValueError, match="live row"):
        cache.shrink(16, live=2)
    cache.shrink(32, live=2)
    assert cache.capacity == 32 and cache.lengths == [10, 20, 0] and cache.logical == [10, 90, 0]
    after = [*cache.keys, *cache.values, *cache.biases]
    for old, new in zip(before, after, strict=True):
        assert new.shape[2] == 32
        assert torch.equal(new[0, :, :10], old[0, :, :10])
        assert torch.equal(new[1, :, :20], old[1, :, :20])
    assert all(not b[2].any() for b in cache.biases)  # the emptied row's, as reset leaves them


def test_a_busy_ar_engine_cuts_the_rows_a_long_prompt_grew_once_it_has_left(tmp_path, monkeypatch):
    """Issue 59: under a steady load the engine never idles, so a batch cache grown for one
    long prompt (every row of it) stayed that size for as long as anything ran. Once the long
    row has left, the cache is cut to what the running rows need, the free is reported, and
    the rows still running answer as they would have alone."""
    from cdlm_serve.engine.decoding.ar_engine import INITIAL_SLOTS
    from cdlm_serve.engine.decoding.sampling import SamplingParams

    engine = _tiny_ar_engine(tmp_path)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    short = [7, 3, 9, 11, 2]
    alone = _tokens(engine, [engine.new_sequence("alone", short, greedy)])["alone"]
    reported: list[int] = []
    monkeypatch.setattr(heap, "freed", reported.append)
    long = engine.new_sequence("long", list(range(300)), SamplingParams(max_tokens=2))
    beside = engine.new_sequence("beside", short, greedy)
    engine.add(long)
    engine.add(beside)
    grown, answer = 0, []
    while long.finish_reason is None:
        answer += [t for o in engine.step() if o.request_id == "beside" for t in o.token_ids]
        assert engine.cache is not None
        grown = max(grown, engine.cache.capacity)
    assert grown > 300 and beside.finish_reason is None  # the short one still runs
    assert engine.cache is not None and engine.cache.capacity == INITIAL_SLOTS
    per_slot = engine.cache.allocated_bytes() // INITIAL_SLOTS
    assert reported == [per_slot * (grown - INITIAL_SLOTS)]
    while engine.has_work():
        answer += [t for o in engine.step() for t in o.token_ids]
    assert answer == alone and len(alone) == 40


def test_idle_engines_release_their_batch_caches_and_answer_alike_after(
    tmp_path, monkeypatch, tiny_dlm_engine
):
    """Engine.release_idle (the engine thread calls it after a while idle): the AR and the
    diffusion engines drop their batch caches, report the bytes, and the next request builds
    them again and gets the same answer."""
    from cdlm_serve.engine.decoding.dlm_sequence import DLMParams
    from cdlm_serve.engine.decoding.sampling import SamplingParams

    reported: list[int] = []
    monkeypatch.setattr(heap, "freed", reported.append)
    ar = _tiny_ar_engine(tmp_path)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    first = _tokens(ar, [ar.new_sequence("a", [5, 6, 7], greedy)])["a"]
    assert ar.cache is not None and ar.kv_bytes() > 0
    held = ar.kv_bytes()
    ar.release_idle()
    assert ar.cache is None and ar.kv_bytes() == 0 and reported == [held]
    assert _tokens(ar, [ar.new_sequence("b", [5, 6, 7], greedy)])["b"] == first

    dlm = tiny_dlm_engine
    prompt = [3, 4, 5, 6]
    params = DLMParams(max_tokens=8, temperature=0.0)
    before = [o.token_ids for o in dlm.generate(prompt, params)]
    held = dlm.kv_bytes()
    assert held > 0
    dlm.release_idle()
    assert dlm.kv_bytes() == 0 and reported[-1] == held
    assert [o.token_ids for o in dlm.generate(prompt, params)] == before
    dlm.release_idle()  # the engine is the module's: leave no cache for the tests after


class RecordingTrimmer(heap.HeapTrimmer):
    """The real trimmer (its thread, its wake-up), also noting each free reported to it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reported: list[int] = []

    def freed(self, nbytes: int) -> None:
        self.reported.append(nbytes)
        super().freed(nbytes)


@pytest.fixture
def trimmed_server(tiny_llama_dir, tmp_path):
    """An in-process server of the tiny model whose trimmer trims only when woken (no periodic
    trim within the test), with a stand-in libc that says when malloc_trim was called; yields
    (its URL, the trimmer, the server's state): in-process, a test sees what the server holds."""
    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ModelSpec
    from conftest import app_in_thread

    settings = ServerSettings(
        [ModelSpec("tiny", str(tiny_llama_dir))],
        torch.device("cpu"),
        torch.float32,
        sessions_dir=tmp_path,
        heap_trim_seconds=3600,
    )
    app = create_app(settings)
    trimmer = RecordingTrimmer(every_s=3600, soon_s=0, libc=FakeLibc())
    app.state.server.heap = trimmer  # before the lifespan starts it (ServerState.load_all)
    with app_in_thread(app, healthy_within=60) as base:
        yield base, trimmer, app.state.server


def _armed(trimmer: RecordingTrimmer, big_bytes: int) -> int:
    """From now on, only a free of `big_bytes` or more wakes the trimmer; its trims so far."""
    time.sleep(0.2)  # a trim woken earlier (the loading's frees) is done
    trimmer.big_bytes = big_bytes
    trimmer.reported.clear()
    return trimmer.trims


def _trimmed_since(trimmer: RecordingTrimmer, trims: int, timeout: float = 20) -> bool:
    """Whether the trimmer trims again within `timeout` seconds (its count, not the libc's
    call: the count goes up just after the call)."""
    deadline = time.monotonic() + timeout
    while trimmer.trims == trims and time.monotonic() < deadline:
        time.sleep(0.05)
    return trimmer.trims > trims


CONTEXT = "The code name of the blue box is Orchid-417. " * 3


def test_deleting_a_session_wakes_the_trimmer_with_its_bytes(trimmed_server):
    """session_access.drop reports the session's cache as freed: a delete is followed by a
    trim, woken by a report of the session's size (issue 42: deleted sessions' caches stayed
    in glibc's arenas until the next periodic trim)."""
    base, trimmer, _ = trimmed_server
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "s", "prompt": CONTEXT})
    assert r.status_code == 201, r.text
    size = r.json()["bytes"]
    trims = _armed(trimmer, big_bytes=size)
    assert httpx.delete(f"{base}/v1/sessions/s").status_code == 200
    assert _trimmed_since(trimmer, trims), f"no trim after the delete: {trimmer.reported}"
    assert size in trimmer.reported


def test_a_compaction_wakes_the_trimmer_with_what_it_gave_back(trimmed_server):
    """The compaction's reference pass grows the session's cache to ~2x its context, and its
    end (compactions._run) reports what the trim of that cache freed: more than the session
    held before, which wakes the trimmer."""
    base, trimmer, _ = trimmed_server
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "c", "prompt": CONTEXT})
    assert r.status_code == 201, r.text
    before = r.json()["bytes"]
    trims = _armed(trimmer, big_bytes=before)
    body = {"ratio": 4, "method": "am-highest", "query_source": "repeat", "keep_recent": 16}
    r = httpx.post(f"{base}/v1/sessions/c/compact", json=body, timeout=300)
    assert r.status_code == 200, r.text
    after = httpx.get(f"{base}/v1/sessions/c").json()["bytes"]
    assert _trimmed_since(trimmer, trims), f"no trim after compacting: {trimmer.reported}"
    assert [n for n in trimmer.reported if n >= before], trimmer.reported
    assert after < before


def test_nothing_holds_a_compactions_caches_once_the_session_is_deleted(trimmed_server):
    """After a compaction and the session's delete, the only KV cache alive is the engine's
    own batch cache (issue 42: the compaction's last piece of model work, run on the core
    share's wide thread, stayed referenced by that thread until its next piece, minutes under
    load, and through it the compaction's fit and its caches outlived the session: ~80 MB on
    SmolLM2 at 1.5K tokens)."""
    from cdlm_serve.models.kv_cache import KVCache

    base, _, state = trimmed_server
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "d", "prompt": CONTEXT})
    assert r.status_code == 201, r.text
    body = {"ratio": 4, "method": "am-highest", "query_source": "repeat", "keep_recent": 16}
    assert httpx.post(f"{base}/v1/sessions/d/compact", json=body, timeout=300).status_code == 200
    assert httpx.delete(f"{base}/v1/sessions/d").status_code == 200
    engine = state.models["tiny"].engine

    def left() -> list[tuple[int, ...]]:
        gc.collect()  # a cycle is not a holder: only what is still reachable counts
        caches = [o for o in gc.get_objects() if type(o) is KVCache and o is not engine.cache]
        return [tuple(c.keys[0].shape) for c in caches if c.keys]

    deadline = time.monotonic() + 10  # the threads that ran it get back to their waits
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []
