"""Sessions: a model's KV cache for a conversation or document, kept between requests.

A session holds the token history whose K/V its cache holds, the cache itself (batch 1, maybe
with compacted segments: fewer physical slots than its logical length, per-slot biases), the
last sampled token not yet run through the model, and the list of compactions applied.

Memory is bounded: past `max_bytes` of caches in memory, the least recently used idle sessions
are written to disk and dropped from memory; any access loads them back. On disk a session is a
folder with `kv.safetensors` (per layer keys/values/biases of the committed slots) and
`meta.json`, each written to a temporary file, fsynced and renamed; `meta.json` is renamed last,
so a folder without it is an interrupted write and is ignored. Sessions are also written when
compacted and when the server shuts down, and are found again on restart.

Each session has a lock: a completion holds it from admission to its last token, a compaction
for its whole run, so the two never interleave on one cache.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.kv_cache import KVCache
from models.fetch import fsync_dir

log = logging.getLogger(__name__)

_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class SessionError(ValueError):
    pass


@dataclass(eq=False)
class Session:
    id: str
    model: str
    tokens: list[int]  # history whose K/V the cache holds, in order
    cache: KVCache | None  # None while it lives on disk only
    pending: int | None = None  # last sampled token, not yet in the cache
    compactions: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def logical_length(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes(0)

    def describe(self) -> dict[str, Any]:
        cache = self.cache
        return {
            "id": self.id,
            "object": "session",
            "model": self.model,
            "created": int(self.created),
            "tokens": len(self.tokens) + (self.pending is not None),
            "logical_length": self.logical_length,
            "physical_tokens": None if cache is None else cache.lengths[0],
            "bytes": self.nbytes(),
            "in_memory": cache is not None,
            "compactions": self.compactions,
        }


class SessionStore:
    def __init__(self, root: Path, max_bytes: int):
        self.root = root
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order, oldest first
        self._lock = threading.Lock()  # guards the table, never held while waiting on a session
        self._discover()

    # ---- table ---------------------------------------------------------------------------
    def _discover(self) -> None:
        for meta_path in sorted(self.root.glob("*/meta.json")):
            try:
                meta = json.loads(meta_path.read_text())
                session = Session(
                    meta["id"],
                    meta["model"],
                    meta["tokens"],
                    None,
                    meta.get("pending"),
                    meta.get("compactions", []),
                    meta.get("created", time.time()),
                )
                self._sessions[session.id] = session
            except (OSError, ValueError, KeyError) as e:
                log.warning("ignoring unreadable session %s: %s", meta_path.parent, e)
        for stale in self.root.glob(".tmp-*"):  # writes that were interrupted
            shutil.rmtree(stale, ignore_errors=True)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def create(self, model: str, session_id: str | None = None) -> Session:
        sid = session_id or f"sess-{uuid.uuid4().hex}"
        if not _ID.fullmatch(sid):
            raise SessionError("session id must be 1-128 of A-Z a-z 0-9 _ . -")
        with self._lock:
            if sid in self._sessions:
                raise SessionError(f"session {sid!r} already exists")
            session = Session(sid, model, [], None)
            self._sessions[sid] = session
        return session

    def get(self, sid: str) -> Session | None:
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None:
                self._sessions.move_to_end(sid)
            return session

    def delete(self, sid: str) -> bool:
        with self._lock:
            session = self._sessions.pop(sid, None)
        if session is None:
            return False
        shutil.rmtree(self.root / sid, ignore_errors=True)
        return True

    # ---- memory ----------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in self._sessions.values())

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*/*") if p.is_file())

    def load(self, session: Session, device: torch.device, dtype: torch.dtype) -> KVCache:
        """The session's cache, read back from disk if it was spilled (hold its lock)."""
        if session.cache is None:
            path = self.root / session.id / "kv.safetensors"
            session.cache = _read_cache(path, device, dtype) if path.exists() else None
        return session.cache

    def enforce_limit(self) -> None:
        """Spill least recently used idle sessions until memory fits the bound."""
        while self.memory_bytes() > self.max_bytes:
            with self._lock:
                victims = [
                    s
                    for s in self._sessions.values()
                    if s.cache is not None and not s.lock.locked()
                ]
            if not victims:
                return
            victim = victims[0]
            if not victim.lock.acquire(blocking=False):
                continue
            try:
                self.persist(victim)
                victim.cache = None
                log.info("spilled session %s to disk", victim.id)
            finally:
                victim.lock.release()

    # ---- disk ------------------------------------------------------------------------------
    def persist(self, session: Session) -> None:
        """Write the session atomically (hold its lock)."""
        final = self.root / session.id
        tmp = self.root / f".tmp-{session.id}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if session.cache is not None:
                _write_cache(session.cache, tmp / "kv.safetensors")
            elif (final / "kv.safetensors").exists():  # spilled already: keep the file
                shutil.copy2(final / "kv.safetensors", tmp / "kv.safetensors")
            meta = {
                "id": session.id,
                "model": session.model,
                "tokens": session.tokens,
                "pending": session.pending,
                "compactions": session.compactions,
                "created": session.created,
            }
            _write_json(meta, tmp / "meta.json")
            fsync_dir(tmp)
            if final.exists():
                old = self.root / f".tmp-old-{session.id}-{uuid.uuid4().hex[:8]}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def persist_all(self) -> None:
        for sid in self.ids():
            session = self.get(sid)
            if session is not None and session.cache is not None:
                with session.lock:
                    self.persist(session)


def _write_cache(cache: KVCache, path: Path) -> None:
    n = cache.lengths[0]
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cache.num_layers):
        keys, values, bias = cache.read(0, layer)
        tensors[f"k.{layer}"] = keys.contiguous().cpu()
        tensors[f"v.{layer}"] = values.contiguous().cpu()
        if bias is not None:
            tensors[f"b.{layer}"] = bias.contiguous().cpu()
    meta = {"length": str(n), "logical": str(cache.logical[0])}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_cache(path: Path, device: torch.device, dtype: torch.dtype) -> KVCache:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    layers = sum(1 for k in tensors if k.startswith("k."))
    n, logical = int(meta["length"]), int(meta["logical"])
    capacity = max(64, n * 2)

    def grow(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        out = torch.zeros(1, t.shape[0], capacity, *t.shape[2:], device=device, dtype=dt)
        out[0, :, :n] = t.to(device=device, dtype=dt)
        return out

    keys = [grow(tensors[f"k.{i}"], dtype) for i in range(layers)]
    values = [grow(tensors[f"v.{i}"], dtype) for i in range(layers)]
    biases = None
    if "b.0" in tensors:
        biases = [grow(tensors[f"b.{i}"], torch.float32) for i in range(layers)]
    return KVCache(keys, values, [n], [logical], biases)


def _write_json(obj: Any, path: Path) -> None:
    with path.open("w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
