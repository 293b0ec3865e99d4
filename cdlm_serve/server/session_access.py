"""Sessions for the routes: the session service (`engine.sessions.service`: lock, lease, load,
commit or roll back) with its errors translated into the API's (`api_error`: 404, 409, 503,
507), in one place.

Every helper here runs its blocking part (disk, Redis) on a worker thread, never on the event
loop, and a change of a session's state is finished even if the request is cancelled
(`unstoppable`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import (
    MirrorError,
    Session,
    SessionBusy,
    SessionConflict,
    SessionError,
    SessionNotFound,
    SessionService,
    unstoppable,
)
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.state import ServerState

__all__ = ["unstoppable"]


def session_error(e: SessionError, param: str = "id") -> APIError:
    if isinstance(e, SessionBusy):
        return APIError(409, str(e), param="session_id", code="session_busy")
    if isinstance(e, SessionNotFound):
        return APIError(404, str(e), param=param, code="session_not_found")
    codes = {400: "invalid_session_id", 409: "session_exists", 507: "session_store_full"}
    return APIError(e.status, str(e), param=param, code=codes.get(e.status))


def tier_error(e: MirrorError) -> APIError:
    if isinstance(e, SessionConflict):
        return APIError(409, str(e), param="session_id", code="session_conflict")
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


def api_error(e: BaseException, sid: str, param: str = "session_id") -> APIError | None:
    """The API's error for what the session service raised (None: not one of its)."""
    if isinstance(e, SessionError):
        return session_error(e, param)
    if isinstance(e, OSError):  # the shared tier (MirrorError), or the local disk
        return storage_error(e, sid, param)
    return None


@contextmanager
def translated(sid: str, param: str = "session_id") -> Iterator[None]:
    """The service's errors inside, as the API's."""
    try:
        yield
    except (SessionError, OSError) as e:
        error = api_error(e, sid, param)
        assert error is not None
        raise error from None


async def find(state: ServerState, sid: str, param: str = "session_id") -> Session:
    """The session (from the shared tier if another replica has it); 404 if there is none."""
    with translated(sid, param):
        return await state.session_service.find(sid)


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


async def acquire(service: SessionService, session: Session, wait: float) -> None:
    """Take the session's lock and lease (409 if they stay busy for `wait` seconds; 404 if it
    was deleted meanwhile)."""
    with translated(session.id):
        await service.acquire(session, wait)


async def release(service: SessionService, session: Session) -> None:
    with translated(session.id):
        await service.release(session)


async def catch_up(service: SessionService, session: Session) -> None:
    """For a read: the session as the shared tier has it, if another replica changed it."""
    with translated(session.id):
        await service.catch_up(session)


@asynccontextmanager
async def opened(
    state: ServerState,
    session: Session,
    write: bool = False,
    served: ServedModel | None = None,
    param: str = "session_id",
) -> AsyncIterator[Session]:
    """`SessionService.open` with the API's errors: the session held (its cache loaded onto
    `served`'s model where given); a write committed on the way out, or rolled back."""
    load = None if served is None else (served.model.device, served.model.dtype)
    with translated(session.id, param):
        async with state.session_service.open(session, write, load) as held:
            yield held


async def persist(service: SessionService, session: Session) -> None:
    """Commit the held session: 507 if the disk refuses, 503 if the shared tier does, 409 if
    another replica changed it meanwhile; on any of them the session, its disk and the tier
    are as they were before this request (`SessionStore.persist`)."""
    with translated(session.id):
        await service.commit(session)


async def load_cache(state: ServerState, served: ServedModel, session: Session) -> None:
    """Bring a spilled session's cache back into memory (hold its lock; a read that fails is
    a 500, `SessionReadError`, not a full disk's 507)."""
    await state.session_service.load(session, (served.model.device, served.model.dtype))


async def spill(service: SessionService) -> None:
    """Keep the session caches in memory within their bound (off the event loop)."""
    await service.spill()


async def drop(service: SessionService, session: Session) -> None:
    """Delete a held session from memory, disk and the shared tier."""
    with translated(session.id):
        await service.delete(session)


async def remove(service: SessionService, session: Session, wait: float | None = None) -> None:
    """`drop` under the session's lock, finished even if the request is cancelled."""
    with translated(session.id):
        await service.remove(session, wait)
