"""Sessions as a service: how anyone uses a session, in one protocol.

    async with sessions.open(session, write=True, load=(device, dtype)) as s:
        ...  # change s (its cache, its tokens, its record)

`open` takes the session's lock (one request at a time on this replica), then its lease among
replicas (the Redis tier), and makes it the shared copy; loads its cache where asked; and on
the way out commits a write (`SessionStore.persist`: the disk, then the tier) before it lets
go. If anything fails inside or at the commit, the session is rolled back to its committed
version (`SessionStore.revert`: memory, disk and tier as they were), and a session that was
never committed is removed whole. The errors are the store's own (`SessionError` and its
kinds with their HTTP status, `OSError` for the disk, `MirrorError` for the tier): the routes
only translate them (`server/session_access.py`).

Every blocking part (disk, Redis, a lock another request holds) runs on a worker thread,
never on the event loop. Callers that must finish a change even if their request is cancelled
wrap the whole `async with` in `unstoppable`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

from cdlm_serve.engine import heap
from cdlm_serve.engine.sessions.session import Session, SessionError, check_id
from cdlm_serve.engine.sessions.store import SessionStore

T = TypeVar("T")
# Where a session's cache is loaded: the model's device and dtype.
Placement = tuple[torch.device, torch.dtype]


class SessionNotFound(SessionError):
    status = 404

    def __init__(self, sid: str, why: str = "does not exist") -> None:
        super().__init__(f"session {sid!r} {why}")


class SessionReadError(RuntimeError):
    """A committed session's files could not be read back (a 500: nothing the client did, and
    nothing changed); not a full disk, which only a write can meet."""


class SessionBusy(SessionError):
    """Its lock or its lease stayed busy for the wait allowed (409)."""

    status = 409

    def __init__(self, sid: str, where: str) -> None:
        super().__init__(
            f"session {sid!r} is busy {where} (a compaction or a completion is running); try again"
        )


async def unstoppable(work: Awaitable[T]) -> T:
    """Finish `work` even if the request is cancelled (a client that goes away must not leave
    a session half-changed: its lock held, its disk write cut short, the table out of step)."""
    return await asyncio.shield(asyncio.ensure_future(work))


@dataclass
class SessionService:
    store: SessionStore
    lock_wait: float = 10.0  # seconds a request waits for a busy session before 409

    async def find(self, sid: str) -> Session:
        """The session (from the shared tier if another replica has it)."""
        check_id(sid)
        session = await asyncio.to_thread(self.store.get, sid)
        if session is None:
            raise SessionNotFound(sid)
        return session

    @asynccontextmanager
    async def open(
        self,
        session: Session,
        write: bool = False,
        load: Placement | None = None,
        wait: float | None = None,
    ) -> AsyncIterator[Session]:
        """The session, held (see the module's doc); `write`: committed on the way out, or
        rolled back on any error; `load`: its cache brought into memory first."""
        await self.acquire(session, self.lock_wait if wait is None else wait)
        try:
            try:
                if load is not None:
                    await self.load(session, load)
                yield session
                if write:
                    await self.commit(session)
            except BaseException:
                if write:
                    await self._roll_back(session)
                raise
        finally:
            await self.release(session)

    async def load(self, session: Session, placement: Placement) -> None:
        """Bring the held session's cache into memory (read back if it was spilled)."""
        try:
            await asyncio.to_thread(self.store.load, session, *placement)
        except OSError as e:
            raise SessionReadError(f"session {session.id!r} could not be read back: {e}") from e

    async def commit(self, session: Session) -> None:
        """Write the held session's change (disk, then tier); on failure it is as before."""
        await asyncio.to_thread(self.store.persist, session)

    async def _roll_back(self, session: Session) -> None:
        if session.version is None:  # never committed: as if it had never been
            self.store.forget(session)
            await asyncio.to_thread(self.store.delete, session)
        else:
            self.store.revert(session)

    async def delete(self, session: Session) -> None:
        """Delete the held session from memory, disk and the shared tier."""
        freed = session.nbytes()
        self.store.forget(session)
        await asyncio.to_thread(self.store.delete, session)
        heap.freed(freed)  # its cache goes with the last reference, just after

    async def remove(self, session: Session, wait: float | None = None) -> None:
        """`delete` under the session's lock, finished even if the request is cancelled."""

        async def delete() -> None:
            async with self.open(session, wait=wait):
                await self.delete(session)

        await unstoppable(delete())

    async def spill(self) -> None:
        """Keep the session caches in memory within their bound (off the event loop)."""
        await asyncio.to_thread(self.store.enforce_limit)

    async def catch_up(self, session: Session) -> None:
        """For a read: the session as the shared tier has it, if another replica changed it.
        A session busy here is being changed by this replica, whose copy is the current one."""
        if self.store.mirror is None or not session.lock.acquire(blocking=False):
            return
        try:
            current = await asyncio.to_thread(self.store.refresh, session, False)
        finally:
            session.lock.release()
        if not current:
            raise SessionNotFound(session.id, "was deleted")

    async def acquire(self, session: Session, wait: float) -> None:
        """Take the session's lock, then its lease among replicas (SessionBusy if either stays
        busy for `wait` seconds), and make it the shared copy (SessionNotFound if it was
        deleted meanwhile). `release` gives them back."""
        if not await asyncio.to_thread(session.lock.acquire, True, wait):
            raise SessionBusy(session.id, "here")
        leased = False
        try:
            if session.deleted:  # by the request this one waited for
                raise SessionNotFound(session.id, "was deleted")
            leased = await self._take_lease(session.id, wait)
            if not leased:
                raise SessionBusy(session.id, "on another replica")
            if not await asyncio.to_thread(self.store.refresh, session):
                raise SessionNotFound(session.id, "was deleted")
        except BaseException:
            if leased:
                await asyncio.to_thread(self.store.drop_lease, session.id)
            session.lock.release()
            raise

    async def release(self, session: Session) -> None:
        """Give back the lease (on a thread: Redis may be slow), then the lock."""
        try:
            await asyncio.to_thread(self.store.drop_lease, session.id)
        finally:
            session.lock.release()

    async def _take_lease(self, sid: str, wait: float) -> bool:
        """The session's lease (on a thread: Redis may be slow). A request cancelled while it
        waits gives the lease back as soon as it arrives, instead of leaving it held (and
        renewed) with nobody to release it."""
        store = self.store
        taking = asyncio.ensure_future(asyncio.to_thread(store.take_lease, sid, wait))
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:

            def give_back(done: asyncio.Future[bool]) -> None:
                if not done.cancelled() and done.exception() is None and done.result():
                    threading.Thread(target=store.drop_lease, args=(sid,), daemon=True).start()

            taking.add_done_callback(give_back)
            raise
