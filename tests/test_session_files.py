"""The on-disk session format: versions that a crash at any step leaves whole, appends that
write only the new slots, start-up recovery."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cdlm_serve.engine.sessions import files as session_files
from cdlm_serve.engine.sessions.files import (
    MAX_SEGMENTS,
    CorruptSession,
    Version,
    read_cache,
    recover,
)
from cdlm_serve.engine.sessions.session import Session
from cdlm_serve.engine.sessions.store import SessionStore
from cdlm_serve.models.kv_cache import KVCache

LAYERS, HEADS, DIM = 2, 2, 8


def _cache(n: int, seed: int, biases: bool = False) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(LAYERS, 1, HEADS, DIM, max(n, 1) + 4, "cpu", torch.float32)
    for layer in range(LAYERS):
        cache.keys[layer][0, :, :n] = torch.randn(HEADS, n, DIM, generator=gen)
        cache.values[layer][0, :, :n] = torch.randn(HEADS, n, DIM, generator=gen)
    if biases:
        cache.biases = [torch.randn(1, HEADS, cache.capacity, generator=gen) for _ in range(LAYERS)]
    cache.lengths, cache.logical = [n], [n + (7 if biases else 0)]
    return cache


def _grown(cache: KVCache, extra: int, seed: int) -> KVCache:
    """`cache` with `extra` new slots after its own (an append)."""
    n = cache.lengths[0]
    out = _cache(n + extra, seed, biases=cache.biases is not None)
    for layer in range(LAYERS):
        out.keys[layer][0, :, :n] = cache.keys[layer][0, :, :n]
        out.values[layer][0, :, :n] = cache.values[layer][0, :, :n]
        if cache.biases is not None:
            out.biases[layer][0, :, :n] = cache.biases[layer][0, :, :n]  # type: ignore[index]
    out.logical = [cache.logical[0] + extra]
    return out


def _same(a: KVCache | None, b: KVCache) -> None:
    assert a is not None and a.lengths == b.lengths and a.logical == b.logical
    for layer in range(LAYERS):
        for x, y in zip(a.read(0, layer), b.read(0, layer), strict=True):
            if y is None:
                assert x is None or not x.any()
            else:
                assert x is not None and torch.equal(x, y)


def _draft(version: Version | None, tokens: list[int], sid: str = "s") -> Version:
    return Version(
        id=sid,
        model="m",
        tokens=tokens,
        next_input=None,
        compactions=[],
        created=0.0,
        length=0,
        logical=0,
        generation=0 if version is None else version.generation,
        segments=[] if version is None else version.segments,
    )


def test_appends_write_only_new_slots_and_read_back_exactly(tmp_path):
    folder = tmp_path / "s"
    cache = _cache(40, 0)
    v1 = session_files.write_version(folder, _draft(None, list(range(40))), cache, 0)
    first = (folder / v1.segments[0].file).stat()
    grown = _grown(cache, 5, 1)
    v2 = session_files.write_version(folder, _draft(v1, list(range(45))), grown, 40)
    assert [(s.start, s.end) for s in v2.segments] == [(0, 40), (40, 45)]
    assert v2.segments[1].bytes < v2.segments[0].bytes / 4  # 5 slots, not 45
    assert (folder / v1.segments[0].file).stat().st_mtime_ns == first.st_mtime_ns
    _same(read_cache(folder, recover(folder), torch.device("cpu"), torch.float32)[0], grown)
    # A compaction rewrites everything, biases included, as one segment.
    compacted = _cache(12, 2, biases=True)
    v3 = session_files.write_version(folder, _draft(v2, list(range(45))), compacted, 0)
    assert [(s.start, s.end) for s in v3.segments] == [(0, 12)]
    assert sorted(p.name for p in folder.iterdir()) == [v3.segments[0].file, "meta.json"]
    assert v3.segments[0].file.startswith("kv-3-")  # generation 3, a unique name
    _same(read_cache(folder, recover(folder), torch.device("cpu"), torch.float32)[0], compacted)


def test_many_appends_are_merged(tmp_path):
    folder = tmp_path / "s"
    cache = _cache(4, 0)
    version = session_files.write_version(folder, _draft(None, [0] * 4), cache, 0)
    for i in range(MAX_SEGMENTS + 2):
        cache = _grown(cache, 2, i + 1)
        version = session_files.write_version(
            folder, _draft(version, [0] * cache.lengths[0]), cache, version.length
        )
        assert len(version.segments) <= MAX_SEGMENTS
    _same(read_cache(folder, recover(folder), torch.device("cpu"), torch.float32)[0], cache)


class Crash(BaseException):
    """Stands for the process dying at that instant (no cleanup code runs for it below)."""


@pytest.mark.parametrize("append", [True, False])
def test_a_crash_at_any_step_leaves_the_old_or_the_new_version(tmp_path, monkeypatch, append):
    """Fail each file-system step of a write in turn (the renames, the fsyncs), as a crash
    there would: recovery then finds exactly the old version or exactly the new one."""
    old_cache = _cache(30, 0)
    new_cache = _grown(old_cache, 6, 1) if append else _cache(9, 3, biases=True)
    steps = 0
    for crash_at in range(1, 40):
        folder = tmp_path / f"run{crash_at}" / "s"
        folder.parent.mkdir()
        v1 = session_files.write_version(folder, _draft(None, [1] * 30), old_cache, 0)
        real_replace, real_fsync = os.replace, os.fsync
        calls = {"n": 0, "crash_at": crash_at}

        def counted(real, calls=calls):
            def step(*args):
                calls["n"] += 1
                if calls["n"] == calls["crash_at"]:
                    raise Crash()
                return real(*args)

            return step

        monkeypatch.setattr(os, "replace", counted(real_replace))
        monkeypatch.setattr(os, "fsync", counted(real_fsync))
        try:
            session_files.write_version(
                folder, _draft(v1, [2] * 36), new_cache, 30 if append else 0
            )
            finished = True
        except Crash:
            finished = False
        finally:
            monkeypatch.setattr(os, "replace", real_replace)
            monkeypatch.setattr(os, "fsync", real_fsync)
        version = recover(folder)
        got = read_cache(folder, version, torch.device("cpu"), torch.float32)[0]
        if version.tokens == [1] * 30:
            assert not finished
            _same(got, old_cache)
        else:
            assert version.tokens == [2] * 36
            _same(got, new_cache)
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
        if finished:
            steps = crash_at - 1
            break
    assert steps >= 4  # the write really had several steps to crash in


def test_recovery_removes_debris_and_keeps_damage_for_a_person(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    good = root / "good"
    v = session_files.write_version(good, _draft(None, [5] * 10, "good"), _cache(10, 0), 0)
    (good / ".meta.json.1234.tmp").write_text("half")
    (good / "kv-99.safetensors").write_bytes(b"orphan")
    never = root / "never"  # a create killed before its first meta.json
    never.mkdir()
    (never / "kv-1.safetensors").write_bytes(b"x")
    damaged = root / "damaged"
    session_files.write_version(damaged, _draft(None, [5] * 10, "damaged"), _cache(10, 0), 0)
    seg = next(damaged.glob("kv-*.safetensors"))
    seg.write_bytes(seg.read_bytes()[:-10])
    (root / ".trash-old-1234").mkdir()
    store = SessionStore(root, 1 << 20)
    assert store.ids() == ["good"]
    assert sorted(p.name for p in good.iterdir()) == [v.segments[0].file, "meta.json"]
    assert not never.exists() and not (root / ".trash-old-1234").exists()
    assert damaged.exists() and seg.exists()  # left alone, not loaded
    with pytest.raises(CorruptSession):
        recover(damaged)
    assert store.disk_bytes() == v.disk_bytes


def test_store_persists_only_what_changed_and_spills_from_disk(tmp_path):
    store = SessionStore(tmp_path, max_bytes=1)
    session = store.create("m", "s")
    cache = _cache(20, 0)
    with session.lock:
        session.rewrite(cache, list(range(20)))
        store.persist(session)
    version = session.version
    with session.lock:
        store.persist(session)  # nothing changed: nothing written
    assert session.version is version
    store.enforce_limit()  # over the (1 byte) memory bound: dropped from memory
    assert session.cache is None
    with session.lock:
        _same(store.load(session, torch.device("cpu"), torch.float32), cache)
        session.extend(_grown(cache, 3, 1), [0, 1, 2], next_input=9)
        store.persist(session)
    assert [(s.start, s.end) for s in session.version.segments] == [(0, 20), (20, 23)]
    again = SessionStore(tmp_path, max_bytes=1 << 20).get("s")
    assert again is not None and again.tokens == [*range(20), 0, 1, 2] and again.next_input == 9
    assert isinstance(again, Session) and again.describe()["physical_tokens"] == 23


def test_delete_is_one_rename(tmp_path):
    store = SessionStore(tmp_path, 1 << 20)
    session = store.create("m", "gone")
    with session.lock:
        session.rewrite(_cache(5, 0), [1] * 5)
        store.persist(session)
    renames: list[tuple[str, str]] = []
    real = os.replace

    def spy(a, b):
        renames.append((Path(a).name, Path(b).name))
        return real(a, b)

    os.replace, saved = spy, os.replace
    try:
        store.delete(session)
    finally:
        os.replace = saved
    assert len(renames) == 1 and renames[0][0] == "gone"
    assert renames[0][1].startswith(".trash-gone-")
    assert list(tmp_path.iterdir()) == [] and store.disk_bytes() == 0


def test_install_checks_a_fetched_version_whole_before_it_replaces_the_local_copy(tmp_path):
    """What the shared tier hands over replaces the local copy only if it is a whole version of
    this session; otherwise the local copy stays exactly as it was."""
    root = tmp_path / "store"
    root.mkdir()
    folder = root / "s"
    local = session_files.write_version(folder, _draft(None, [5] * 10), _cache(10, 0), 0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = session_files.write_version(elsewhere / "s", _draft(None, [6] * 12), _cache(12, 1), 0)
    meta = (elsewhere / "s" / "meta.json").read_bytes()
    files = {seg.file: (elsewhere / "s" / seg.file).read_bytes() for seg in theirs.segments}
    other = session_files.write_version(
        elsewhere / "t", _draft(None, [7] * 12, "t"), _cache(12, 1), 0
    )
    bad = [
        (meta, {name: blob[:-10] for name, blob in files.items()}),  # a truncated segment
        (meta, {}),  # a segment missing
        ((elsewhere / "t" / "meta.json").read_bytes(), {other.segments[0].file: b""}),
        (meta, {"../escape.safetensors": b"x", **files}),  # not a segment name
        (b"{not json", files),
    ]
    for fetched_meta, fetched_files in bad:
        with pytest.raises(CorruptSession):
            session_files.install(folder, fetched_meta, fetched_files)
        assert session_files.read_version(folder) == local
    assert not (root.parent / "escape.safetensors").exists()
    installed = session_files.install(folder, meta, files)
    assert installed == theirs and session_files.read_version(folder) == theirs
    assert sorted(p.name for p in root.iterdir()) == ["s"]  # no staging or trash left
