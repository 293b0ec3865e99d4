"""The session store: sessions (`engine/sessions/session.py`: a model's KV cache for a conversation
or document, kept between requests) in memory and on disk.

Every change a client is told about is on disk first (`SessionStore.persist`, in the versioned
format of `engine.sessions.files`: a crash at any moment leaves the last complete version), and
a change that cannot be written is not made: the session is its committed version again.
Memory is bounded: past `max_bytes` of caches in memory, the least recently used idle sessions
are dropped from memory (they are on disk already); any access loads them back. Disk is bounded
too: at most `max_sessions` sessions and `max_disk_bytes` of files; a request that would go past
either is refused (`SessionLimit`), never answered by deleting someone else's session.

Session ids follow one rule (`SESSION_ID`), checked wherever an id enters, and every folder the
store touches is checked to lie directly inside its root.

Each session has a lock: a completion holds it from admission to its last token, a compaction
for its whole run, so the two never interleave on one cache.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from cdlm_serve.engine import heap
from cdlm_serve.engine.sessions import files as session_files
from cdlm_serve.engine.sessions.files import CorruptSession, Version
from cdlm_serve.engine.sessions.mirror import MirrorError, SessionMirror, stamp
from cdlm_serve.engine.sessions.packed_cache import PackedCache
from cdlm_serve.engine.sessions.session import (
    Session,
    SessionError,
    SessionExists,
    SessionLimit,
    check_id,
    from_version,
    take_version,
)
from cdlm_serve.models.kv_cache import KVCache

log = logging.getLogger(__name__)
FETCH_STRIPES = 64


class SessionStore:
    def __init__(
        self,
        root: Path,
        max_bytes: int,
        max_sessions: int = 1024,
        max_disk_bytes: int | None = None,
        mirror: SessionMirror | None = None,
    ):
        root.mkdir(parents=True, exist_ok=True)
        self.mirror = mirror  # the shared tier (engine.sessions.mirror), if any
        # One fetch of a session at a time: a lock per stripe of ids, a fixed number of them
        # (a lock per id would grow with every id ever fetched, every response's).
        self._fetching = [threading.Lock() for _ in range(FETCH_STRIPES)]
        self.root = root.resolve()
        self.max_bytes = max_bytes  # caches kept in memory
        self.max_sessions = max_sessions
        self.max_disk_bytes = max_disk_bytes
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order, oldest first
        self._lock = threading.Lock()  # guards the table, never held while waiting on a session
        self._disk_bytes = 0  # of the distinct files the sessions' versions name
        # Files by identity, each counted once however many sessions name it (a response and
        # its forks share segment files: hard links): (device, inode, size, mtime) -> [bytes,
        # sessions naming it]; and the identities each session's version names.
        self._files: dict[tuple[int, int, int, int], list[int]] = {}
        self._charged: dict[str, list[tuple[int, int, int, int]]] = {}
        # Writes that failed and changed nothing (`persist`), by where: "disk" or "tier".
        self.write_failures = {"disk": 0, "tier": 0}
        self._discover()

    # ---- paths -----------------------------------------------------------------------------
    def folder(self, sid: str) -> Path:
        """The session's folder, checked to lie directly inside the root (defence in depth:
        ids are checked where they enter, and a symlink planted in the root is refused)."""
        path = (self.root / check_id(sid)).resolve()
        if path.parent != self.root or path.name != sid:
            raise SessionError(f"session {sid!r} resolves outside the session store")
        return path

    # ---- table -----------------------------------------------------------------------------
    def _discover(self) -> None:
        session_files.empty_trash(self.root)
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                folder = self.folder(path.name)
                version = session_files.recover(folder)
            except (SessionError, CorruptSession, OSError) as e:
                log.warning("not loading %s: %s", path, e)
                continue
            if version is None:
                log.info("removed %s: a create that was never committed", path)
                continue
            self._sessions[version.id] = from_version(version)
            self._charge(version.id, version)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def all(self) -> list[Session]:
        """Every session, oldest use first (without counting this as a use)."""
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, model: str, session_id: str | None = None, fresh: bool = False) -> Session:
        """A new session in the table (not yet on disk: `persist` it before answering). A
        `fresh` id (a new random one, as are those made here) cannot be another replica's, so
        the shared tier is not asked: no blocking I/O then."""
        fresh = fresh or session_id is None
        sid = check_id(session_id) if session_id is not None else f"sess-{uuid.uuid4().hex}"
        self.folder(sid)
        shared = not fresh and self.mirror is not None and self.mirror.current(sid) is not None
        with self._lock:
            if sid in self._sessions or shared:
                raise SessionExists(f"session {sid!r} already exists")
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimit(
                    f"the session store is full ({self.max_sessions} sessions); "
                    "delete sessions you no longer need"
                )
            session = Session(sid, model, [], None)
            self._sessions[sid] = session
        return session

    def fork(self, parent: Session, session_id: str) -> Session:
        """A new session `session_id` (a fresh random id) that starts where `parent` is (hold
        parent's lock, with parent committed and its cache loaded). The cache moves to the
        fork, which is about to grow it (parent reads its own back from disk when next used:
        no copy in memory), and the fork's first commit links parent's segment files instead
        of writing them again (`session_files.write_version`). Not on disk until it is
        persisted; no blocking I/O."""
        if parent.dirty or parent.version is None:
            raise SessionError(f"session {parent.id!r} has changes not yet stored")
        session = self.create(parent.model, session_id, fresh=True)
        session.tokens = list(parent.tokens)
        session.next_input = parent.next_input
        session.compactions = [dict(c) for c in parent.compactions]
        session.auto_compact = parent.auto_compact
        session.cache, session.codes = parent.cache, parent.codes
        parent.cache = parent.codes = None
        session.base = parent.version
        session.disk_slots = parent.version.length
        return session

    def get(self, sid: str) -> Session | None:
        """The session, from the shared tier if this replica does not have it (blocking I/O
        then: not for the event loop)."""
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None:
                self._sessions.move_to_end(sid)
                return session
        return None if self.mirror is None else self._adopt(sid)

    def _adopt(self, sid: str) -> Session | None:
        """A session another replica created or changed last: its shared copy, fetched into
        our folder and our table."""
        assert self.mirror is not None
        with self._fetch_lock(sid):
            with self._lock:
                if sid in self._sessions:  # fetched meanwhile
                    return self._sessions[sid]
                if len(self._sessions) >= self.max_sessions:
                    raise SessionLimit(
                        f"this replica holds {self.max_sessions} sessions, its limit; "
                        "delete sessions you no longer need"
                    )
            version = self.mirror.fetch(sid, self.folder(sid))
            if version is None:
                return None
            try:
                self.check_room(version.disk_bytes)
            except SessionLimit:
                session_files.trash(self.folder(sid))  # the shared copy stays
                raise
            self._charge(sid, version)
            with self._lock:
                self._sessions[sid] = from_version(version)
                return self._sessions[sid]

    def _fetch_lock(self, sid: str) -> threading.Lock:
        return self._fetching[zlib.crc32(sid.encode()) % FETCH_STRIPES]

    # ---- the shared tier ---------------------------------------------------------------------
    def take_lease(self, sid: str, wait: float) -> bool:
        """The right to change the session among all replicas (always, without a tier)."""
        return self.mirror is None or self.mirror.acquire(sid, wait)

    def drop_lease(self, sid: str) -> None:
        if self.mirror is not None:
            self.mirror.release(sid)

    def refresh(self, session: Session, publish: bool = True) -> bool:
        """Make the session the shared copy, which is the truth: another replica may have
        changed it, or this replica's last change may have been refused by the tier (hold its
        lock, and its lease to `publish`; blocking I/O). False if it was deleted (here or
        through another replica: it is then gone here too)."""
        if session.deleted:
            return False
        if self.mirror is None or session.version is None:
            return True
        shared = self.mirror.current(session.id)
        if shared == stamp(session.version):
            return True
        if shared is None:
            if self.mirror.deleted(session.id):
                self._delete_local(session)
                return False
            # The tier never had it (it was added later, or lost its data): ours is the copy.
            if publish:
                self.mirror.publish(
                    session.id, self.folder(session.id), session.version, parent=None
                )
            return True
        with self._fetch_lock(session.id):
            version = self.mirror.fetch(session.id, self.folder(session.id))
        if version is None:  # deleted between the two reads
            self._delete_local(session)
            return False
        self._charge(session.id, version)
        take_version(session, version)
        return True

    def delete(self, session: Session) -> None:
        """Remove a session from the table, the shared tier and the disk (hold its lock and
        lease; blocking I/O)."""
        if self.mirror is not None and session.version is not None:
            self.mirror.remove(session.id)  # first: if the tier is down, nothing is deleted
        self._delete_local(session)

    def _delete_local(self, session: Session) -> None:
        with self._lock:
            if self._sessions.get(session.id) is session:
                del self._sessions[session.id]
        if session.version is not None:
            self._charge(session.id, None)
        session.deleted = True
        session_files.trash(self.folder(session.id))
        session.version = None

    def forget(self, session: Session) -> None:
        """Drop a session that was never committed (its create failed)."""
        with self._lock:
            if self._sessions.get(session.id) is session and session.version is None:
                del self._sessions[session.id]

    # ---- limits ----------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in self._sessions.values())

    def _charge(self, sid: str, version: Version | None) -> None:
        """Count the files `version` names as session `sid`'s disk use (None: it has none
        now), instead of what it named before: a file several sessions name (linked by a
        fork) counts once, until the last of them lets it go."""
        named = []
        if version is not None:
            folder = self.folder(sid)
            for seg in version.segments:
                try:
                    st = os.stat(folder / seg.file)
                    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                except OSError:  # gone meanwhile (deleted through another replica): its size
                    key = (-1, hash((sid, seg.file)), seg.bytes, 0)
                named.append((key, seg.bytes))
        with self._lock:
            for key in self._charged.pop(sid, []):
                entry = self._files.get(key)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        self._disk_bytes -= entry[0]
                        del self._files[key]
            for key, size in named:
                entry = self._files.setdefault(key, [size, 0])
                if entry[1] == 0:
                    self._disk_bytes += size
                entry[1] += 1
            if named:
                self._charged[sid] = [key for key, _ in named]

    def disk_bytes(self) -> int:
        return self._disk_bytes

    def check_room(self, extra_bytes: int) -> None:
        """Refuse work that would take the store past its disk quota (checked when a request
        that grows a session is admitted; one request may go past by at most its own size)."""
        if self.max_disk_bytes is None:
            return
        if self._disk_bytes + extra_bytes > self.max_disk_bytes:
            raise SessionLimit(
                f"the session store's disk quota is used up ({self._disk_bytes / 1e9:.2f} of "
                f"{self.max_disk_bytes / 1e9:.2f} GB, this request needs up to "
                f"{extra_bytes / 1e6:.1f} MB more); delete or compact sessions"
            )

    def enforce_limit(self) -> None:
        """Pack idle sessions whose cache has codes or padding (`PackedCache`: fewer bytes until
        their next request), then drop least recently used idle caches from memory until they
        fit the bound (each is on disk first; one the disk refuses stays in memory). Blocking
        I/O: not for the event loop."""
        with self._lock:
            candidates = [s for s in self._sessions.values() if s.cache is not None]
        for session in candidates:
            if not session.lock.acquire(blocking=False):
                continue  # in use
            try:
                cache = session.cache
                clean = cache is not None and not session.dirty  # on disk as it is
                if clean and cache is not None and PackedCache.saves_memory(cache, session.codes):
                    session.packed = PackedCache.pack(cache, session.codes)
                    session.cache = session.codes = None
            finally:
                session.lock.release()
        with self._lock:
            candidates = [
                s for s in self._sessions.values() if s.cache is not None or s.packed is not None
            ]
        for victim in candidates:  # least recently used first
            if self.memory_bytes() <= self.max_bytes:
                return
            if victim.version is None:
                continue  # being made (a create, a response's fork): its request commits it
            if not victim.lock.acquire(blocking=False):
                continue  # in use
            try:
                self.persist(victim, publish=False)  # no lease here: never written through
                victim.cache = victim.packed = None
                log.info("spilled session %s to disk", victim.id)
            except OSError as e:  # a change never answered: reverted, its cache dropped too
                log.warning("could not spill session %s: %s", victim.id, e)
            finally:
                victim.lock.release()

    # ---- disk ------------------------------------------------------------------------------
    def load(self, session: Session, device: torch.device, dtype: torch.dtype) -> KVCache | None:
        """The session's cache, unpacked or read back from disk if it was packed or spilled
        (hold its lock)."""
        if session.cache is None and session.packed is not None:
            (session.cache, session.codes), session.packed = session.packed.unpack(), None
        if session.cache is None and session.version is not None and session.version.segments:
            session.cache, session.codes = session_files.read_cache(
                self.folder(session.id), session.version, device, dtype
            )
            session.disk_slots = session.version.length
        return session.cache

    def persist(self, session: Session, publish: bool = True) -> None:
        """Commit the session's current state to disk, if it changed (hold its lock), and with
        a shared tier write it through (`publish`; hold the lease too). All or nothing: a write
        that fails (a full disk, the tier down or refusing) leaves the disk and the tier as they
        were, and the session as its committed version again (`revert`: what the failed request
        changed in memory is dropped, the cache read back from disk when next used), then
        raises. (A tier whose reply is lost after its commit has the new version: the shared
        copy, the truth, replaces ours at the next use.)"""
        with session.io_lock:
            try:
                self._persist(session, publish)
            except BaseException as e:
                self._count_failure(e)
                self.revert(session)
                raise

    def revert(self, session: Session) -> None:
        """Drop what a failed request changed: the session is its committed version again,
        its cache read back from disk when next used (hold its lock). One never committed (a
        create, a fork) is left as it is: its request discards it."""
        if session.version is None or session.deleted:
            return
        freed = session.nbytes()
        take_version(session, session.version)
        session.base = None
        heap.freed(freed)

    def _count_failure(self, e: BaseException) -> None:
        where = "tier" if isinstance(e, MirrorError) else "disk" if isinstance(e, OSError) else None
        if where is not None:
            with self._lock:
                self.write_failures[where] += 1

    def _persist(self, session: Session, publish: bool) -> None:
        if not session.dirty or session.deleted:
            return
        if session.cache is None and session.tokens and session.version is not None:
            return  # spilled or packed: what is on disk is what there is
        old = session.version
        base = session.base if old is None else None  # a fork's first commit
        draft = Version(
            id=session.id,
            model=session.model,
            tokens=session.tokens,
            next_input=session.next_input,
            compactions=session.compactions,
            created=session.created,
            length=0,
            logical=0,
            generation=0 if old is None else old.generation,
            segments=old.segments if old is not None else [] if base is None else base.segments,
            auto_compact=None if session.auto_compact is None else session.auto_compact.to_json(),
            response=session.response,
        )
        folder = self.folder(session.id)
        pending = session_files.stage(
            folder,
            draft,
            session.cache,
            session.disk_slots,
            session.codes,
            link_from=None if base is None else self.folder(base.id),
        )
        try:
            session_files.commit(pending)
            if self.mirror is not None and publish:  # written through before anyone is told
                self.mirror.publish(session.id, folder, pending.version, parent=old)
        except BaseException:
            session_files.abandon(pending)  # the local disk as it was: the tier refused it
            raise
        committed = session_files.finish(pending)
        session.base = None
        self._charge(session.id, committed)
        session.version = committed
        session.disk_slots = committed.length
        session.dirty = False

    def persist_all(self) -> None:
        for sid in self.ids():
            session = self.get(sid)
            if session is not None and session.dirty:
                with session.lock:
                    self.persist(session, publish=False)
