"""The shared session tier: every committed session version written through to Redis, so that any
replica can continue a session another one created, and per-session leases so that two replicas
never change one session at once.

Keys (all under `prefix`, default "cdlm:session:"):

    <id>:meta            the committed version's meta.json (`engine.session_files` format)
    <id>:gen             its "<generation>:<commit>" (a replica whose copy differs fetches it)
    <id>:seg:<file>:<i>  the version's segment files in parts of `chunk_bytes` (Redis holds at
                         most 512 MB in a value; unique names: immutable once written)
    <id>:lease           the owner token of the replica changing the session (with an expiry)
    <id>:gone            a tombstone left by a delete (a replica's stale copy is not revived)

Publishing writes the new segment files first, then meta and gen together in one Lua script (the
commit point), which refuses unless this replica still holds the lease and the shared copy is
still the version the new one was made from; then it drops the segments only the old one named.
A fetch reads meta, then the segments it names (re-reading meta if a newer version dropped one
meanwhile), checks them whole and installs them in the local folder (`session_files.install`): a
crash leaves the old copy or none, never a mix. Deleting drops meta and gen and leaves a tombstone
(the commit point), then drops the segments.

The shared copy is the truth: a replica whose copy differs from it (another replica changed the
session, or this replica's own last change was refused) fetches it before using the session.

A lease is a SET NX with an expiry and a random owner token, renewed by a background thread
while held and released (only by its owner: a Lua check-and-delete) when the request ends; a
replica that dies holding one loses it after `lease_seconds`.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

import redis

from engine import session_files
from engine.session_files import CorruptSession, Version

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

CHUNK_BYTES = 64 << 20  # segment bytes per Redis value (Redis refuses values over 512 MB)
TOMBSTONE_SECONDS = 30 * 24 * 3600  # how long a delete is remembered for replicas' old copies

# Only the owner (its token) may renew or drop a lease.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
# The commit point of a publish, all or nothing: only the lease's owner, and only over the
# version its own was made from (ARGV[2]: that version's "<generation>:<commit>", "" for a new
# session). Returns {status, the replaced meta or the current version}.
_COMMIT = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return {'lease', ''} end
local current = redis.call('get', KEYS[2]) or ''
if current ~= ARGV[2] then return {'conflict', current} end
local old = redis.call('get', KEYS[3]) or ''
redis.call('set', KEYS[3], ARGV[4])
redis.call('set', KEYS[2], ARGV[3])
redis.call('del', KEYS[4])
return {'ok', old}
"""


class MirrorError(OSError):
    """The shared tier could not be read or written (Redis down, a lease lost)."""


class SessionConflict(MirrorError):
    """The shared copy is not the version a change was made from (another replica changed or
    created the session meanwhile): the change is not stored."""


def stamp(version: Version) -> str:
    """What identifies a committed version among replicas."""
    return f"{version.generation}:{version.commit}"


class SessionMirror:
    def __init__(
        self,
        url: str,
        prefix: str = "cdlm:session:",
        lease_seconds: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        # Without decode_responses: its replies are bytes (redis-py types them bytes | str).
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes  # every replica of one tier must use the same
        self.lease_ms = int(lease_seconds * 1000)
        self._release = self.client.register_script(_RELEASE)
        self._renew = self.client.register_script(_RENEW)
        self._commit = self.client.register_script(_COMMIT)
        self._held: dict[str, str] = {}  # session id -> our lease token
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        renewer = threading.Thread(target=self._renew_loop, name="lease-renewer", daemon=True)
        renewer.start()

    def _key(self, sid: str, part: str) -> str:
        return f"{self.prefix}{sid}:{part}"

    # ---- versions --------------------------------------------------------------------------
    def current(self, sid: str) -> str | None:
        """The shared copy's "<generation>:<commit>" (None: there is none)."""
        value = cast(bytes | None, self._call(self.client.get, self._key(sid, "gen")))
        return None if value is None else value.decode()

    def deleted(self, sid: str) -> bool:
        """Whether the session was deleted (recently) through the shared tier."""
        return bool(self._call(self.client.exists, self._key(sid, "gone")))

    def publish(self, sid: str, folder: Path, version: Version, parent: Version | None) -> None:
        """Write a committed local version through. It replaces the shared copy only if that
        is still `parent` (the version it was made from; None for a new session) and this
        replica still holds the session's lease: SessionConflict, or MirrorError, otherwise."""
        token = self._token(sid)
        names = [s.file for s in version.segments]
        for name in names:  # unique names: a segment already there holds these very bytes
            data = (folder / name).read_bytes()
            pipe = self.client.pipeline(transaction=False)
            for i, key in enumerate(self._part_keys(sid, name, len(data))):
                pipe.set(key, data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes], nx=True)
            self._call(pipe.execute)
        status, other = self._call(
            self._commit,
            keys=[self._key(sid, p) for p in ("lease", "gen", "meta", "gone")],
            args=[
                token or "",
                "" if parent is None else stamp(parent),
                stamp(version),
                json.dumps(version.to_json()),
            ],
        )
        if status == b"lease":
            raise MirrorError(f"lost the lease of session {sid!r}; not stored")
        if status == b"conflict":
            raise SessionConflict(f"session {sid!r} was changed elsewhere ({other.decode()})")
        if other:  # best effort: segments only the replaced version named
            old = json.loads(other)["segments"]
            self._forget_segments(sid, [s for s in old if s["file"] not in names])

    def fetch(self, sid: str, folder: Path) -> Version | None:
        """Install the shared copy in `folder` (replacing what is there); None if there is
        none. The caller holds the session's lock (or the session is not in the table yet)."""
        for _ in range(3):
            meta = cast(bytes | None, self._call(self.client.get, self._key(sid, "meta")))
            if meta is None:
                return None
            try:
                segments = [(s["file"], int(s["bytes"])) for s in json.loads(meta)["segments"]]
            except (ValueError, KeyError, TypeError) as e:
                raise MirrorError(
                    f"the shared copy of session {sid!r} is unreadable: {e}"
                ) from None
            files: dict[str, bytes] = {}
            for name, size in segments:
                parts = cast(
                    list[bytes | None],
                    self._call(self.client.mget, self._part_keys(sid, name, size)),
                )
                if any(p is None for p in parts):
                    break  # a newer version was published meanwhile and dropped this one
                files[name] = b"".join(cast(list[bytes], parts))  # none is missing
            else:
                try:
                    return session_files.install(folder, meta, files)
                except CorruptSession as e:
                    raise MirrorError(f"the shared copy of session {sid!r}: {e}") from None
        raise MirrorError(f"session {sid!r} kept changing while it was fetched")

    def remove(self, sid: str) -> None:
        """Delete the shared copy, leaving a tombstone for a while: a replica that still has
        a copy then deletes its own instead of publishing it again."""
        meta = self._call(self.client.get, self._key(sid, "meta"))
        commit = self.client.pipeline(transaction=True)
        commit.delete(self._key(sid, "meta"), self._key(sid, "gen"))
        commit.set(self._key(sid, "gone"), 1, ex=TOMBSTONE_SECONDS)
        self._call(commit.execute)
        if meta:
            self._forget_segments(sid, json.loads(meta)["segments"])

    def _part_keys(self, sid: str, name: str, size: int) -> list[str]:
        parts = max(1, -(-size // self.chunk_bytes))
        return [self._key(sid, f"seg:{name}:{i}") for i in range(parts)]

    def _forget_segments(self, sid: str, segments: list[dict[str, Any]]) -> None:
        """Drop the keys of segments no version names any more (best effort: a leftover only
        costs space)."""
        keys = [k for s in segments for k in self._part_keys(sid, s["file"], int(s["bytes"]))]
        if not keys:
            return
        try:
            self.client.delete(*keys)
        except redis.RedisError as e:
            log.warning("could not drop old segments of session %s: %s", sid, e)

    # ---- leases ----------------------------------------------------------------------------
    def acquire(self, sid: str, wait: float) -> bool:
        """Take the session's lease, waiting up to `wait` seconds for another replica's."""
        token = secrets.token_hex(16)
        deadline = time.monotonic() + wait
        while True:
            if self._call(
                self.client.set, self._key(sid, "lease"), token, nx=True, px=self.lease_ms
            ):
                with self._held_lock:
                    self._held[sid] = token
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def release(self, sid: str) -> None:
        with self._held_lock:
            token = self._held.pop(sid, None)
        if token is not None:
            try:
                self._release(keys=[self._key(sid, "lease")], args=[token])
            except redis.RedisError as e:  # it expires by itself
                log.warning("could not release the lease of session %s: %s", sid, e)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            with self._held_lock:
                held = dict(self._held)
            for sid, token in held.items():
                try:
                    kept = self._renew(keys=[self._key(sid, "lease")], args=[token, self.lease_ms])
                except redis.RedisError as e:
                    log.warning("could not renew the lease of session %s: %s", sid, e)
                    continue
                if not kept:  # expired and maybe taken: our publish will be refused
                    log.warning("lost the lease of session %s", sid)
                    with self._held_lock:
                        if self._held.get(sid) == token:
                            del self._held[sid]

    def _token(self, sid: str) -> str | None:
        with self._held_lock:
            return self._held.get(sid)

    def close(self) -> None:
        self._stop.set()
        self.client.close()

    @staticmethod
    def _call(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            raise MirrorError(f"the shared session tier failed: {e}") from None
