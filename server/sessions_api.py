"""The sessions API: create, inspect, delete, compact; and completions that continue from a
session's cache.

Every answer that reports a change comes after the change is on disk (`SessionStore.persist`,
run on a worker thread, never on the event loop). Model work (prefilling a session's prompt,
a compaction's query capture) runs in pieces on the model's engine thread between decode steps
(`EngineThread.run`); a compaction's fits run on the server's compaction thread, one compaction
at a time, at most `MAX_WAITING_COMPACTIONS` more waiting.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine import model_work
from engine.core_share import CoreShare
from engine.kv_compaction import OnEngine, compact_row
from engine.served_model import ServedModel
from engine.session_mirror import MirrorError, SessionConflict
from engine.session_store import Session, SessionError, SessionStore, check_id
from models.kv_cache import KVCache
from server import completions, planning, streaming
from server.errors import APIError, error_body
from server.schemas import CompactRequest, CompletionRequest, SessionCreateRequest

if TYPE_CHECKING:
    from server.app import ServerState

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_WAITING_COMPACTIONS = 4
# A compaction must shrink what it compacts at least this much (smaller gains are not worth a
# fit, and `ratio` near 1 would ask OMP for almost every key).
MIN_RATIO = 1.5


def session_error(e: SessionError, param: str = "id") -> APIError:
    codes = {400: "invalid_session_id", 409: "session_exists", 507: "session_store_full"}
    return APIError(e.status, str(e), param=param, code=codes.get(e.status))


def tier_error(e: MirrorError) -> APIError:
    return APIError(503, str(e), param="session_id", code="session_tier_unavailable")


async def find(state: ServerState, sid: str, param: str = "session_id") -> Session:
    """The session (from the shared tier if another replica has it); 404 if there is none."""
    try:
        check_id(sid)
    except SessionError as e:
        raise session_error(e, param) from None
    try:
        session = await asyncio.to_thread(state.sessions.get, sid)
    except MirrorError as e:
        raise tier_error(e) from None
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
    return KVCache.bytes_per_slot(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, served.model.dtype
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
        if isinstance(e, MirrorError):
            raise tier_error(e) from None
        raise


async def _take_lease(store: SessionStore, sid: str, wait: float) -> bool:
    """The session's lease (on a thread: Redis may be slow). A request cancelled while it
    waits gives the lease back as soon as it arrives, instead of leaving it held (and renewed)
    with nobody to release it."""
    taking = asyncio.ensure_future(asyncio.to_thread(store.take_lease, sid, wait))
    try:
        return await asyncio.shield(taking)
    except asyncio.CancelledError:

        def give_back(done: asyncio.Future) -> None:
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
    except MirrorError as e:
        raise tier_error(e) from None
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
    """Commit the session to disk (hold its lock); 507 if the disk refuses."""
    try:
        await asyncio.to_thread(store.persist, session)
    except SessionConflict as e:
        raise APIError(409, str(e), param="session_id", code="session_conflict") from None
    except MirrorError as e:  # not stored: the shared copy replaces ours at the next use
        raise tier_error(e) from None
    except OSError as e:
        raise APIError(
            507,
            f"could not store session {session.id!r}: {e.strerror or e}",
            param="session_id",
            code="session_store_full",
        ) from None


async def load_cache(state: ServerState, served: ServedModel, session: Session) -> None:
    """Bring a spilled session's cache back into memory (hold its lock)."""
    await asyncio.to_thread(state.sessions.load, session, served.model.device, served.model.dtype)


async def spill(store: SessionStore) -> None:
    """Keep the session caches in memory within their bound (off the event loop)."""
    await asyncio.to_thread(store.enforce_limit)


@asynccontextmanager
async def using(state: ServerState, session: Session) -> AsyncIterator[None]:
    """Hold the session's lock while a completion continues it (409 if it stays busy). On the
    way out, whatever happened (an answer, an abort, a cancelled request), what the engine
    appended is committed and only then is the lock released, shielded from cancellation: the
    lock never goes while a write of the session is still running."""
    await acquire(state.sessions, session, state.settings.session_lock_wait)

    async def finish() -> None:
        try:
            await persist(state.sessions, session)
        except APIError as e:  # the answer already said so, or was never asked for
            log.warning("session %s not stored: %s", session.id, e.message)
        finally:
            await release(state.sessions, session)
        await spill(state.sessions)

    try:
        yield
    finally:
        await unstoppable(finish())


async def continue_session(
    state: ServerState, served: ServedModel, req: CompletionRequest, request: Request
) -> Response:
    """POST /v1/completions with `session_id`: continue from the session's cache. With
    `append`, the grown session is on disk before the answer (or the stream's [DONE])."""
    session = await find(state, req.session_id)
    if session.model != req.model:
        raise APIError(
            400, f"session {session.id!r} belongs to model {session.model!r}", param="model"
        )
    if (
        req.n != 1
        or not isinstance(req.prompt, str | list)
        or (isinstance(req.prompt, list) and not all(isinstance(t, int) for t in req.prompt))
    ):
        raise APIError(400, "a session completion takes one prompt and n = 1", param="prompt")
    events = _continuation(state, served, session, req, request)
    await anext(events)  # admitted, or an error before any response starts
    if req.stream:
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        return JSONResponse(await anext(events))
    finally:
        await events.aclose()


async def _continuation(
    state: ServerState,
    served: ServedModel,
    session: Session,
    req: CompletionRequest,
    request: Request,
) -> AsyncIterator[Any]:
    """Yields None once admitted (the session locked and loaded, the request planned), then
    the stream's chunks or the one response body."""
    store = state.sessions
    async with using(state, session):
        await load_cache(state, served, session)
        choices = planning.plan_session(served, req, session)
        if req.append:
            grows = len(choices[0].prompt_ids) + choices[0].params.max_tokens
            try:
                store.check_room(grows * bytes_per_token(served))
            except SessionError as e:
                raise session_error(e, "session_id") from None
        yield None
        if not req.stream:
            body = await streaming.until_disconnected(
                request, completions.complete(served, req, choices, state.metrics)
            )
            await persist(store, session)
            yield body
            return
        done = streaming.sse("[DONE]")
        async for chunk in completions.stream(served, req, choices, state.metrics):
            if chunk == done:  # committed before the client hears it is done
                try:
                    await persist(store, session)
                except APIError as e:
                    yield streaming.sse(error_body(e.status, e.message, e.param))
            yield chunk


class Compactions:
    """The compaction thread, and how many compactions are in it (running or waiting)."""

    def __init__(self, cores: CoreShare) -> None:
        self.cores = cores  # the fits run on the thread's share, beside the engine threads
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compaction")
        self._count = 0
        self._lock = threading.Lock()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        with self._lock:
            if self._count > MAX_WAITING_COMPACTIONS:
                raise APIError(
                    429,
                    f"{self._count} compactions are already running or waiting; try again",
                    headers={"Retry-After": "10"},
                )
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1

    async def run(self, fn, *args: Any, on_engine: OnEngine, **kwargs: Any) -> Any:
        """`fn(*args, on_engine=..., on_fit=..., **kwargs)` on the compaction thread. It counts
        as busy in the core share while it fits (each fit through the share, `on_fit`), and as
        idle while a piece of its model work runs on the engine thread (`on_engine`)."""

        def piece(work: Callable[[], T]) -> T:
            self.cores.leave()
            try:
                return on_engine(work)
            finally:
                self.cores.enter()

        def job() -> Any:
            with self.cores.working():
                return fn(*args, on_engine=piece, on_fit=self.cores.run, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def install(app: FastAPI, state: ServerState, errors: dict) -> None:
    store = state.sessions
    wait = state.settings.session_lock_wait
    links = {
        "GetSession": {"operationId": "get_session", "parameters": {"sid": "$response.body#/id"}},
        "CompactSession": {
            "operationId": "compact_session",
            "parameters": {"sid": "$response.body#/id"},
        },
        "ContinueSession": {
            "operationId": "create_completion",
            "requestBody": {
                "model": "$response.body#/model",
                "session_id": "$response.body#/id",
                "prompt": "Q:",
                "max_tokens": 4,
            },
        },
        "DeleteSession": {
            "operationId": "delete_session",
            "parameters": {"sid": "$response.body#/id"},
        },
    }
    session_errors = {**errors, 507: errors[400]}

    @app.post(
        "/v1/sessions",
        status_code=201,
        operation_id="create_session",
        responses={**session_errors, 201: {"description": "the session", "links": links}},
    )
    async def create_session(req: SessionCreateRequest):
        served = state.get(req.model)
        if served.is_diffusion:
            raise APIError(400, "sessions are for autoregressive models", param="model")
        ids: list[int] = []
        if req.prompt is not None:
            ids = (
                planning.encode(served, req.prompt)
                if isinstance(req.prompt, str)
                else list(req.prompt)
            )
            if any(not 0 <= t < served.config.vocab_size for t in ids):
                raise APIError(
                    400, "prompt holds a token id outside the vocabulary", param="prompt"
                )
            if len(ids) >= served.max_model_len:
                raise APIError(
                    400,
                    f"prompt of {len(ids)} tokens does not fit the model's "
                    f"context ({served.max_model_len})",
                    param="prompt",
                )
        try:
            store.check_room(len(ids) * bytes_per_token(served))
            session = await asyncio.to_thread(store.create, req.model, req.id)
        except SessionError as e:
            raise session_error(e) from None
        except MirrorError as e:
            raise tier_error(e) from None

        async def build() -> None:
            try:
                async with locked(store, session, wait):
                    if ids:
                        cache = await asyncio.to_thread(
                            model_work.prefill,
                            served.model,
                            ids,
                            served.thread.run,
                            served.thread.has_requests,
                        )
                        session.rewrite(cache, ids)
                    await persist(store, session)
            except BaseException:
                if session.version is None:  # never committed: as if it had never been
                    store.forget(session)
                    await asyncio.to_thread(store.delete, session)
                raise
            await spill(store)

        await unstoppable(build())
        return JSONResponse(session.describe(), status_code=201)

    @app.get("/v1/sessions", operation_id="list_sessions", responses=errors)
    async def list_sessions():
        return {"object": "list", "data": [s.describe() for s in store.all()]}

    @app.get("/v1/sessions/{sid}", operation_id="get_session", responses=errors)
    async def get_session(sid: str):
        session = await find(state, sid)
        await catch_up(store, session)
        return session.describe()

    @app.delete("/v1/sessions/{sid}", operation_id="delete_session", responses=errors)
    async def delete_session(sid: str):
        session = await find(state, sid)

        async def remove() -> None:
            async with locked(store, session, wait):
                try:
                    await asyncio.to_thread(store.delete, session)
                except MirrorError as e:
                    raise tier_error(e) from None

        await unstoppable(remove())
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @app.post(
        "/v1/sessions/{sid}/compact", operation_id="compact_session", responses=session_errors
    )
    async def compact_session(sid: str, req: CompactRequest):
        session = await find(state, sid)
        served = model_for(state, session)
        if (req.ratio is None) == (req.target_tokens is None):
            raise APIError(400, "give exactly one of ratio and target_tokens", param="ratio")
        async with state.compactions.slot():
            body = await unstoppable(_compact(state, served, session, req))
        return {"id": sid, "object": "session.compaction", **body, "session": session.describe()}


async def _compact(
    state: ServerState, served: ServedModel, session: Session, req: CompactRequest
) -> dict:
    async with locked(state.sessions, session, state.settings.session_lock_wait):
        await load_cache(state, served, session)
        cache = session.cache
        if cache is None or cache.lengths[0] == 0:
            raise APIError(400, "the session's cache is empty", param="session_id")
        region = cache.lengths[0] - req.keep_recent
        if region < 2:
            raise APIError(
                400,
                f"keep_recent={req.keep_recent} leaves too little of the "
                f"{cache.lengths[0]} cached tokens to compact",
                param="keep_recent",
            )
        if req.target_tokens is not None:
            target = req.target_tokens
            if target * MIN_RATIO > region:
                raise APIError(
                    400,
                    f"target_tokens={target} must be at most 1/{MIN_RATIO} of the {region} "
                    "tokens to compact",
                    param="target_tokens",
                )
        else:  # ratio >= MIN_RATIO (the schema says so)
            target = max(1, math.ceil(region / req.ratio))
            if target >= region:
                raise APIError(
                    400, f"ratio={req.ratio} leaves the {region} tokens as they are", param="ratio"
                )
        history = list(session.tokens)
        try:
            report = await state.compactions.run(
                compact_row,
                served.model,
                served.tokenizer,
                cache,
                0,
                history,
                target,
                req.method,
                req.query_source,
                req.keep_recent,
                on_engine=served.thread.run,
                omp_budget=state.settings.compaction_omp_budget,
                urgent=served.thread.has_requests,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        body = report.to_dict()
        session.compactions.append(body)
        session.rewrite(cache)
        await persist(state.sessions, session)
    state.metrics.compaction_seconds.labels(req.method).observe(report.seconds["total"])
    state.metrics.compaction_ratio.labels(req.method).observe(report.ratio)
    return body
