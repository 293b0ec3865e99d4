"""The shared session tier: every committed session version written through to Redis, so that any
replica can continue a session another one created, and per-session leases so that two replicas
never change one session at once.

Keys (all under `prefix`, default "cdlm:session:"):

    <id>:meta            the committed version's meta.json (`engine.session_files` format)
    <id>:gen             its generation (a replica whose copy is older fetches the new one)
    <id>:seg:<file>      the version's segment files, immutable once written
    <id>:lease           the owner token of the replica changing the session (with an expiry)
    <id>:gone            a tombstone left by a delete (a replica's stale copy is not revived)

Publishing writes the new segment files first, then meta and gen together (MULTI: the commit
point), then drops the segments no version names any more. A fetch reads meta, then the segments
it names (re-reading meta if a newer version dropped one meanwhile), and installs them in the
local folder with the same atomic protocol as a local write: a crash leaves the old copy or the
new one. Deleting drops meta and gen first (the commit point), then the segments.

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
from pathlib import Path

import redis

from engine import session_files
from engine.session_files import Version

log = logging.getLogger(__name__)

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


class MirrorError(OSError):
    """The shared tier could not be read or written (Redis down, a version lost)."""


class SessionMirror:
    def __init__(self, url: str, prefix: str = "cdlm:session:", lease_seconds: float = 30.0):
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self.prefix = prefix
        self.lease_ms = int(lease_seconds * 1000)
        self._release = self.client.register_script(_RELEASE)
        self._renew = self.client.register_script(_RENEW)
        self._held: dict[str, str] = {}  # session id -> our lease token
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        renewer = threading.Thread(target=self._renew_loop, name="lease-renewer", daemon=True)
        renewer.start()

    def _key(self, sid: str, part: str) -> str:
        return f"{self.prefix}{sid}:{part}"

    # ---- versions --------------------------------------------------------------------------
    def generation(self, sid: str) -> int | None:
        """The generation of the shared copy (None: there is none)."""
        value = self._call(self.client.get, self._key(sid, "gen"))
        return None if value is None else int(value)

    def publish(self, sid: str, folder: Path, version: Version) -> None:
        """Write a committed local version through (the caller holds the session's lease)."""
        names = [s.file for s in version.segments]
        seg_keys = [self._key(sid, f"seg:{name}") for name in names]
        present = self._call(self.client.exists, *seg_keys) if seg_keys else 0
        if present != len(seg_keys):  # segments are immutable: only new ones are sent
            pipe = self.client.pipeline(transaction=False)
            for name, key in zip(names, seg_keys, strict=True):
                pipe.set(key, (folder / name).read_bytes(), nx=True)
            self._call(pipe.execute)
        commit = self.client.pipeline(transaction=True)  # meta and gen together: the commit
        commit.set(self._key(sid, "meta"), json.dumps(version.to_json()).encode())
        commit.set(self._key(sid, "gen"), version.generation)
        commit.delete(self._key(sid, "gone"))  # an id may be used again after a delete
        self._call(commit.execute)
        self._drop_segments(sid, keep=set(names))

    def fetch(self, sid: str, folder: Path) -> Version | None:
        """Install the shared copy in `folder` (replacing what is there); None if there is
        none. The caller holds the session's lock (or the session is not in the table yet)."""
        for _ in range(3):
            meta = self._call(self.client.get, self._key(sid, "meta"))
            if meta is None:
                return None
            version = Version.from_json(json.loads(meta))
            keys = [self._key(sid, f"seg:{s.file}") for s in version.segments]
            blobs = self._call(self.client.mget, keys) if keys else []
            if all(b is not None for b in blobs):
                files = {s.file: b for s, b in zip(version.segments, blobs, strict=True)}
                return session_files.install(folder, meta, files)
            # A newer version was published between the two reads: read it again.
        raise MirrorError(f"session {sid!r} kept changing while it was fetched")

    def remove(self, sid: str) -> None:
        """Delete the shared copy, leaving a tombstone for a while: a replica that still has
        a copy then deletes its own instead of publishing it again."""
        commit = self.client.pipeline(transaction=True)
        commit.delete(self._key(sid, "meta"), self._key(sid, "gen"))
        commit.set(self._key(sid, "gone"), 1, ex=TOMBSTONE_SECONDS)
        self._call(commit.execute)
        self._drop_segments(sid, keep=set())

    def deleted(self, sid: str) -> bool:
        """Whether the session was deleted (recently) through the shared tier."""
        return bool(self._call(self.client.exists, self._key(sid, "gone")))

    def _drop_segments(self, sid: str, keep: set[str]) -> None:
        pattern = self._key(sid, "seg:*")
        marker = len(self._key(sid, "seg:"))
        stale = [
            k
            for k in self._call(lambda: list(self.client.scan_iter(match=pattern, count=100)))
            if k.decode()[marker:] not in keep
        ]
        if stale:
            self._call(self.client.delete, *stale)

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
                    self._renew(keys=[self._key(sid, "lease")], args=[token, self.lease_ms])
                except redis.RedisError as e:
                    log.warning("could not renew the lease of session %s: %s", sid, e)

    def close(self) -> None:
        self._stop.set()
        self.client.close()

    @staticmethod
    def _call(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            raise MirrorError(f"the shared session tier failed: {e}") from None
