"""Using a session from a request: finding it (404), its lock and its lease among replicas
(409 while busy), bringing its cache back from disk, committing a change to disk (507 when the
disk refuses) before anyone is told of it, and the errors these become.

Every helper here runs its blocking part (disk, Redis) on a worker thread, never on the event
loop, and a change of a session's state is finished even if the request is cancelled
(`unstoppable`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from cdlm_serve.engine import heap
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import (
    MirrorError,
    Session,
    SessionConflict,
    SessionError,
    SessionStore,
    check_id,
)
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.state import ServerState

T = TypeVar("T")


def session_error(e: SessionError, param: str = "id") -> APIError:
    codes = {400: "invalid_session_id", 409: "session_exists", 507: "session_store_full"}
    return APIError(e.status, str(e), param=param, code=codes.get(e.status))


def tier_error(e: MirrorError) -> APIError:
    return APIError(503, str(e), param="session_id", code="session_tier_unavailable")


def disk_error(e: OSError, sid: str, param: str = "session_id") -> APIError:
    """The local session store could not write (a full disk, a quota, a file size limit):
    507, and nothing was changed (`SessionStore.persist`)."""
    return APIError(
        507,
        f"the session store is out of space: could not write session {sid!r} "
        f"({e.strerror or e}); nothing was changed. Free disk space or delete sessions",
        param=param,
        code="session_store_full",
    )


def storage_error(e: OSError, sid: str, param: str = "session_id") -> APIError:
    """The API error of a failed read or write of the session store: the shared tier's
    (503) or the local disk's (507)."""
    return tier_error(e) if isinstance(e, MirrorError) else disk_error(e, sid, param)


async def find(state: ServerState, sid: str, param: str = "session_id") -> Session:
    """The session (from the shared tier if another replica has it); 404 if there is none."""
    try:
        check_id(sid)
    except SessionError as e:
        raise session_error(e, param) from None
    try:
        session = await asyncio.to_thread(state.sessions.get, sid)
    except OSError as e:  # the shared tier, or the local disk it is fetched into
        raise storage_error(e, sid, param) from None
    except SessionError as e:  # no room here for another replica's session
        raise session_error(e, param) from None
    if session is None:
        raise APIError(
            404, f"session {sid!r} does not exist", param=param, code="session_not_found"
        )
    return session


def model_for(state: ServerState, session: Session) -> ServedModel:
    served = state.get(session.model)
    if served.is_diffusion:
        raise APIError(400, "sessions are for autoregressive models", param="model")
    return served


def bytes_per_token(served: ServedModel) -> int:
    cfg = served.config
    # Global layers only: sliding-window layers hold a ring of fixed size, not a slot a token.
    return KVCache.bytes_per_slot(
        len(cfg.global_layers), cfg.num_kv_heads, cfg.head_dim, served.model.dtype
    )


def _busy(session: Session, where: str) -> APIError:
    return APIError(
        409,
        f"session {session.id!r} is busy {where} (a compaction or a completion is running); "
        "try again",
        param="session_id",
        code="session_busy",
    )


def _gone(session: Session) -> APIError:
    return APIError(
        404, f"session {session.id!r} was deleted", param="session_id", code="session_not_found"
    )


async def acquire(store: SessionStore, session: Session, wait: float) -> None:
    """Take the session's lock, then its lease among replicas (409 if either stays busy for
    `wait` seconds), and make it the shared copy (404 if it was deleted meanwhile)."""
    if not await asyncio.to_thread(session.lock.acquire, True, wait):
        raise _busy(session, "here")
    leased = False
    try:
        if session.deleted:  # by the request this one waited for
            raise _gone(session)
        leased = await _take_lease(store, session.id, wait)
        if not leased:
            raise _busy(session, "on another replica")
        if not await asyncio.to_thread(store.refresh, session):
            raise _gone(session)
    except BaseException as e:
        if leased:
            await asyncio.to_thread(store.drop_lease, session.id)
        session.lock.release()
        if isinstance(e, OSError):  # refreshing it from the shared tier
            raise storage_error(e, session.id) from None
        raise


async def _take_lease(store: SessionStore, sid: str, wait: float) -> bool:
    """The session's lease (on a thread: Redis may be slow). A request cancelled while it
    waits gives the lease back as soon as it arrives, instead of leaving it held (and renewed)
    with nobody to release it."""
    taking = asyncio.ensure_future(asyncio.to_thread(store.take_lease, sid, wait))
    try:
        return await asyncio.shield(taking)
    except asyncio.CancelledError:

        def give_back(done: asyncio.Future[bool]) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                threading.Thread(target=store.drop_lease, args=(sid,), daemon=True).start()

        taking.add_done_callback(give_back)
        raise


async def catch_up(store: SessionStore, session: Session) -> None:
    """For a read: the session as the shared tier has it, if another replica changed it. A
    session busy here is being changed by this replica, whose copy is the current one."""
    if store.mirror is None or not session.lock.acquire(blocking=False):
        return
    try:
        current = await asyncio.to_thread(store.refresh, session, False)
    except OSError as e:
        raise storage_error(e, session.id) from None
    finally:
        session.lock.release()
    if not current:
        raise _gone(session)


async def release(store: SessionStore, session: Session) -> None:
    """Give back the lease (on a thread: Redis may be slow), then the lock."""
    try:
        await asyncio.to_thread(store.drop_lease, session.id)
    finally:
        session.lock.release()


@asynccontextmanager
async def locked(store: SessionStore, session: Session, wait: float = 10.0) -> AsyncIterator[None]:
    """Hold the session's lock and lease (409 if they stay busy for `wait` seconds)."""
    await acquire(store, session, wait)
    try:
        yield
    finally:
        await release(store, session)


async def unstoppable(work: Awaitable[T]) -> T:
    """Finish `work` even if the request is cancelled (a client that goes away must not leave
    a session half-changed: its lock held, its disk write cut short, the table out of step)."""
    return await asyncio.shield(asyncio.ensure_future(work))


async def persist(store: SessionStore, session: Session) -> None:
    """Commit the session to disk (hold its lock): 507 if the disk refuses, 503 if the shared
    tier does, 409 if another replica changed it meanwhile; on any of them the session, its
    disk and the tier are as they were before this request (`SessionStore.persist`)."""
    try:
        await asyncio.to_thread(store.persist, session)
    except SessionConflict as e:
        raise APIError(409, str(e), param="session_id", code="session_conflict") from None
    except OSError as e:
        raise storage_error(e, session.id) from None


async def load_cache(state: ServerState, served: ServedModel, session: Session) -> None:
    """Bring a spilled session's cache back into memory (hold its lock)."""
    await asyncio.to_thread(state.sessions.load, session, served.model.device, served.model.dtype)


async def spill(store: SessionStore) -> None:
    """Keep the session caches in memory within their bound (off the event loop)."""
    await asyncio.to_thread(store.enforce_limit)


async def drop(store: SessionStore, session: Session) -> None:
    """Delete a session from memory, disk and the shared tier (hold its lock and lease); one
    never committed is dropped from the table too."""
    freed = session.nbytes()
    store.forget(session)
    try:
        await asyncio.to_thread(store.delete, session)
    except OSError as e:
        raise storage_error(e, session.id) from None
    heap.freed(freed)  # its cache goes with the last reference, just after


async def remove(store: SessionStore, session: Session, wait: float) -> None:
    """`drop` under the session's lock, finished even if the request is cancelled."""

    async def delete() -> None:
        async with locked(store, session, wait):
            await drop(store, session)

    await unstoppable(delete())
