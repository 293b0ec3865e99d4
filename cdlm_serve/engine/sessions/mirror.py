"""The shared session tier: every committed session version written through to Redis, so that any
replica can continue a session another one created, and per-session leases so that two replicas
never change one session at once.

Keys (all under `prefix`, default "cdlm:session:"):

    <id>:meta            the committed version's meta.json (`engine.sessions.files` format)
    <id>:blobs           its segment files' SHA-256 digests, JSON: {"version": its gen,
                         "files": {file: digest}}
    <id>:gen             its "<generation>:<commit>" (a replica whose copy differs fetches it)
    <id>:lease           the owner token of the replica changing the session (with an expiry)
    <id>:gone            a tombstone left by a delete (a replica's stale copy is not revived)
    blob:<digest>:<i>    a segment file's bytes in parts of `chunk_bytes` (Redis holds at most
                         512 MB in a value), stored once for every session that names it
    blob:<digest>:refs   the versions that name it, as "<id>@<generation>:<commit>"

Segments are shared by content. A response forked from another hard-links its segment files
(`session_files.write_version(link_from=...)`), so a conversation of N turns names its first
turn's segment N times: kept once per session, the tier would hold N^2/2 turns' worth. A blob
lives while some version names it: a version adds its reference before it uploads or relies on
the bytes, and a version replaced or deleted drops its references, the last one removing the
bytes, in one Lua script (a reference added after that script finds the bytes gone and uploads
them again). Each version's references carry its own unique commit id, so a replica whose
publish was refused drops only its own. A replica that dies between adding references and its
commit leaves them behind: the blob then stays (space, never a loss).

Publishing adds the references and uploads what is missing, then writes meta, blobs and gen
together in one Lua script (the commit point), which refuses unless this replica still holds
the lease and the shared copy is still the version the new one was made from; then it drops the
replaced version's references. A fetch reads meta and blobs (one MGET), then the blobs they
name (re-reading them if a newer version dropped one meanwhile), checks each against its
digest and installs them in the local folder (`session_files.install`): a crash leaves the old
copy or none, never a mix. Deleting drops meta, blobs and gen and leaves a tombstone (the commit
point), then drops the references. Versions published before blobs were shared (no `blobs`
key, or one left by a later version: a replica not yet upgraded published over it) are read from
their per-session keys (`<id>:seg:<file>:<i>`), dropped when replaced.

The shared copy is the truth: a replica whose copy differs from it (another replica changed the
session, or this replica's own last change was refused) fetches it before using the session.

A lease is a SET NX with an expiry and a random owner token, renewed by a background thread
while held and released (only by its owner: a Lua check-and-delete) when the request ends; a
replica that dies holding one loses it after `lease_seconds`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

import redis

from cdlm_serve.engine.sessions import files as session_files
from cdlm_serve.engine.sessions.files import CorruptSession, Version

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

CHUNK_BYTES = 64 << 20  # segment bytes per Redis value (Redis refuses values over 512 MB)
TOMBSTONE_SECONDS = 30 * 24 * 3600  # how long a delete is remembered for replicas' old copies
DIGESTS_KEPT = 4096  # segment files whose digest a mirror remembers (by inode)

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
# session). Returns {status, the replaced meta or the current version, the replaced blobs}.
_COMMIT = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return {'lease', '', ''} end
local current = redis.call('get', KEYS[2]) or ''
if current ~= ARGV[2] then return {'conflict', current, ''} end
local old = redis.call('get', KEYS[3]) or ''
local old_blobs = redis.call('get', KEYS[5]) or ''
redis.call('set', KEYS[3], ARGV[4])
redis.call('set', KEYS[5], ARGV[5])
redis.call('set', KEYS[2], ARGV[3])
redis.call('del', KEYS[4])
return {'ok', old, old_blobs}
"""
# One version (ARGV[1]) stops naming a blob (KEYS[1]: its references, the rest: its parts);
# the last reference removes the bytes. Atomic: a reference added later finds them gone.
_UNREF = """
redis.call('srem', KEYS[1], ARGV[1])
if redis.call('scard', KEYS[1]) == 0 then
  for i = 2, #KEYS do redis.call('del', KEYS[i]) end
  return 1
end
return 0
"""


class MirrorError(OSError):
    """The shared tier could not be read or written (Redis down, a lease lost)."""


class SessionConflict(MirrorError):
    """The shared copy is not the version a change was made from (another replica changed or
    created the session meanwhile): the change is not stored."""


def stamp(version: Version) -> str:
    """What identifies a committed version among replicas."""
    return f"{version.generation}:{version.commit}"


def _digests(meta: dict[str, Any], blobs: bytes | None) -> dict[str, str] | None:
    """The digests of a version's segment files by name; None for a version published before
    blobs were shared (the record missing, or a later version's: a replica not upgraded yet
    published over it)."""
    if not blobs:
        return None
    record = json.loads(blobs)
    if record["version"] != f"{meta['generation']}:{meta['commit']}":
        return None
    return {str(name): str(digest) for name, digest in record["files"].items()}


def _inode(path: Path) -> tuple[int, ...]:
    """What tells a file's bytes apart while it lives: its inode (shared by hard links), size
    and modification time."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _reference(sid: str, generation: Any, commit: Any) -> str:
    """A version's name in a blob's references (session ids have no "@")."""
    return f"{sid}@{generation}:{commit}"


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
        self._unref = self.client.register_script(_UNREF)
        self._held: dict[str, str] = {}  # session id -> our lease token
        self._held_lock = threading.Lock()
        # (device, inode, size, mtime) -> SHA-256: a forked session's hard-linked segments are
        # hashed once, not at every turn's publish.
        self._digests: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._digests_lock = threading.Lock()
        self._stop = threading.Event()
        renewer = threading.Thread(target=self._renew_loop, name="lease-renewer", daemon=True)
        renewer.start()

    def _key(self, sid: str, part: str) -> str:
        return f"{self.prefix}{sid}:{part}"

    def _blob_key(self, digest: str, part: str) -> str:
        return f"{self.prefix}blob:{digest}:{part}"

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
        digests = {s.file: self._digest(folder / s.file) for s in version.segments}
        sizes = {digests[s.file]: s.bytes for s in version.segments}
        files = {digests[s.file]: folder / s.file for s in version.segments}
        ours = _reference(sid, version.generation, version.commit)
        try:
            self._upload(ours, sizes, files)
        except MirrorError:
            self._forget_blobs(ours, sizes)  # never committed (best effort: the tier may be down)
            raise
        status, other, other_blobs = self._call(
            self._commit,
            keys=[self._key(sid, p) for p in ("lease", "gen", "meta", "gone", "blobs")],
            args=[
                token or "",
                "" if parent is None else stamp(parent),
                stamp(version),
                json.dumps(version.to_json()),
                json.dumps({"version": stamp(version), "files": digests}),
            ],
        )  # raising, it may have committed: our references stay (at worst a leftover)
        if status in (b"lease", b"conflict"):
            self._forget_blobs(ours, sizes)  # never committed: nothing else has them
        if status == b"lease":
            raise MirrorError(f"lost the lease of session {sid!r}; not stored")
        if status == b"conflict":
            raise SessionConflict(f"session {sid!r} was changed elsewhere ({other.decode()})")
        if other:  # best effort: the replaced version's references (or old per-session keys)
            self._forget_version(sid, other, other_blobs)

    def fetch(self, sid: str, folder: Path) -> Version | None:
        """Install the shared copy in `folder` (replacing what is there); None if there is
        none. The caller holds the session's lock (or the session is not in the table yet)."""
        for _ in range(3):
            meta, blobs = self._shared_copy(sid)
            if meta is None:
                return None
            try:
                version = json.loads(meta)
                segments = [(s["file"], int(s["bytes"])) for s in version["segments"]]
                digests = _digests(version, blobs)
                keys = {
                    name: self._legacy_keys(sid, name, size)
                    if digests is None
                    else self._part_keys(digests[name], size)
                    for name, size in segments
                }
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise MirrorError(
                    f"the shared copy of session {sid!r} is unreadable: {e!r}"
                ) from None
            files: dict[str, bytes] = {}
            for name, _ in segments:
                parts = cast(list[bytes | None], self._call(self.client.mget, keys[name]))
                if any(p is None for p in parts):
                    break  # a newer version was published meanwhile and dropped this one
                files[name] = b"".join(cast(list[bytes], parts))  # none is missing
                if digests is not None and hashlib.sha256(files[name]).hexdigest() != digests[name]:
                    raise MirrorError(f"the shared copy of session {sid!r}: {name} is damaged")
            else:
                try:
                    installed = session_files.install(folder, meta, files)
                except CorruptSession as e:
                    raise MirrorError(f"the shared copy of session {sid!r}: {e}") from None
                if digests is not None:  # checked above: the next publish need not hash them
                    for name in files:
                        self._remember(folder / name, digests[name])
                return installed
        raise MirrorError(f"session {sid!r} kept changing while it was fetched")

    def remove(self, sid: str) -> None:
        """Delete the shared copy, leaving a tombstone for a while: a replica that still has
        a copy then deletes its own instead of publishing it again."""
        meta, blobs = self._shared_copy(sid)
        commit = self.client.pipeline(transaction=True)
        commit.delete(*(self._key(sid, p) for p in ("meta", "gen", "blobs")))
        commit.set(self._key(sid, "gone"), 1, ex=TOMBSTONE_SECONDS)
        self._call(commit.execute)
        if meta:
            self._forget_version(sid, meta, blobs)

    def _shared_copy(self, sid: str) -> tuple[bytes | None, bytes | None]:
        """The shared copy's meta and blobs record, read together (one commit set both)."""
        meta, blobs = cast(
            list[bytes | None],
            self._call(self.client.mget, [self._key(sid, "meta"), self._key(sid, "blobs")]),
        )
        return meta, blobs

    # ---- segment bytes ---------------------------------------------------------------------
    def _digest(self, path: Path) -> str:
        """A segment file's SHA-256 (files are immutable; hard links share the inode)."""
        key = _inode(path)
        with self._digests_lock:
            if key in self._digests:
                self._digests.move_to_end(key)
                return self._digests[key]
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        self._remember(path, digest, key)
        return digest

    def _remember(self, path: Path, digest: str, key: tuple[int, ...] | None = None) -> None:
        with self._digests_lock:
            self._digests[key or _inode(path)] = digest
            while len(self._digests) > DIGESTS_KEPT:
                self._digests.popitem(last=False)

    def _upload(self, ours: str, sizes: dict[str, int], files: dict[str, Path]) -> None:
        """Reference every blob of a version, then upload those not whole in the tier. In this
        order, a blob found whole stays: its last other reference could only drop it before
        ours was added."""
        pipe = self.client.pipeline(transaction=False)
        for digest in sizes:
            pipe.sadd(self._blob_key(digest, "refs"), ours)
        for digest, size in sizes.items():
            pipe.exists(*self._part_keys(digest, size))
        found = self._call(pipe.execute)[len(sizes) :]
        for (digest, size), whole in zip(sizes.items(), found, strict=True):
            keys = self._part_keys(digest, size)
            if whole == len(keys):
                continue
            data = files[digest].read_bytes()
            pipe = self.client.pipeline(transaction=False)
            for i, key in enumerate(keys):  # same digest, same bytes: any copy there is ours
                pipe.set(key, data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes], nx=True)
            self._call(pipe.execute)

    def _parts(self, size: int) -> range:
        """The indices of a file's parts of `chunk_bytes` (one for an empty file)."""
        return range(max(1, -(-size // self.chunk_bytes)))

    def _part_keys(self, digest: str, size: int) -> list[str]:
        return [self._blob_key(digest, str(i)) for i in self._parts(size)]

    def _legacy_keys(self, sid: str, name: str, size: int) -> list[str]:
        """Where a version published before blobs were shared keeps a segment file."""
        return [self._key(sid, f"seg:{name}:{i}") for i in self._parts(size)]

    def _forget_version(self, sid: str, meta: bytes, blobs: bytes | None) -> None:
        """Drop what a replaced or deleted version held (best effort: a leftover only costs
        space)."""
        try:
            old = json.loads(meta)
            segments = [(str(s["file"]), int(s["bytes"])) for s in old["segments"]]
            digests = _digests(old, blobs)
            if digests is None:  # published before blobs were shared: its own keys
                keys = [k for name, size in segments for k in self._legacy_keys(sid, name, size)]
                if keys:
                    self.client.delete(*keys)
                return
            sizes = {str(digests[name]): size for name, size in segments}
            self._forget_blobs(_reference(sid, old["generation"], old["commit"]), sizes)
        except (ValueError, KeyError, TypeError, AttributeError, redis.RedisError) as e:
            log.warning("could not drop the old segments of session %s: %r", sid, e)

    def _forget_blobs(self, ours: str, sizes: dict[str, int]) -> None:
        """Drop one version's references; blobs nobody names any more go (best effort)."""
        pipe = self.client.pipeline(transaction=False)
        for digest, size in sizes.items():
            keys = [self._blob_key(digest, "refs"), *self._part_keys(digest, size)]
            self._unref(keys=keys, args=[ours], client=pipe)
        try:
            pipe.execute()
        except redis.RedisError as e:
            log.warning("could not drop the references of %s: %s", ours, e)

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
