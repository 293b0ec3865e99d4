"""The sessions API: create, inspect, delete, compact; and completions that continue from a
session's cache.

Every answer that reports a change comes after the change is on disk (`SessionStore.persist`,
run on a worker thread, never on the event loop: `server/session_access.py`). Model work
(prefilling a session's prompt, a compaction's query capture) runs in pieces on the model's
engine thread between decode steps (`EngineThread.run`); compactions, requested or asked for
by a session's online policy after an append, are `server/compactions.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cdlm_serve.engine.compaction import AutoCompact
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import MirrorError, Session, SessionError
from cdlm_serve.server import completions, planning, streaming
from cdlm_serve.server.compactions import after_append, compact, compaction_spec
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.schemas import (
    ERROR_RESPONSES,
    SESSION_ERROR_RESPONSES,
    AutoCompactSpec,
    CompactRequest,
    CompletionRequest,
    SessionCreateRequest,
)
from cdlm_serve.server.session_access import (
    acquire,
    bytes_per_token,
    catch_up,
    drop,
    find,
    load_cache,
    model_for,
    opened,
    persist,
    release,
    remove,
    session_error,
    spill,
    tier_error,
    unstoppable,
)
from cdlm_serve.server.state import ServerState, State

log = logging.getLogger(__name__)


@asynccontextmanager
async def using(
    state: ServerState,
    served: ServedModel,
    session: Session,
    keep: Callable[[], bool] = lambda: True,
) -> AsyncIterator[None]:
    """Hold the session's lock while a completion continues it (409 if it stays busy). On the
    way out, whatever happened (an answer, an abort, a cancelled request), what the engine
    appended is committed and only then is the lock released, shielded from cancellation: the
    lock never goes while a write of the session is still running. A session `keep()` then
    refuses (a response that was never finished) is removed instead, under the same lock:
    never written, so a crash cannot leave it behind."""
    await acquire(state.session_service, session, state.settings.session_lock_wait)

    async def finish() -> None:
        kept = keep()
        try:
            await (persist if kept else drop)(state.session_service, session)
        except APIError as e:  # the answer already said so, or was never asked for
            log.warning("session %s not stored: %s", session.id, e.message)
        finally:
            await release(state.session_service, session)
        if kept:
            after_append(state, served, session)
        await spill(state.session_service)

    try:
        yield
    finally:
        await unstoppable(finish())


async def continue_session(
    state: ServerState, served: ServedModel, req: CompletionRequest, request: Request
) -> Response:
    """POST /v1/completions with `session_id`: continue from the session's cache. With
    `append`, the grown session is on disk before the answer (or the stream's [DONE])."""
    assert req.session_id is not None  # create_completion's check
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
    return await streaming.answer_when_admitted(events, req.stream)


async def _continuation(
    state: ServerState,
    served: ServedModel,
    session: Session,
    req: CompletionRequest,
    request: Request,
) -> AsyncGenerator[Any, None]:
    """Yields None once admitted (the session locked and loaded, the request planned), then
    the stream's chunks or the one response body."""
    store, service = state.sessions, state.session_service
    async with using(state, served, session):
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
            await persist(service, session)
            yield body
            return

        async def commit() -> APIError | None:  # before the client hears it is done
            try:
                await persist(service, session)
            except APIError as e:
                return e
            return None

        kind = completions.STREAM
        async for chunk in streaming.stream(served, req, choices, state.metrics, kind, commit):
            yield chunk


def auto_compact_policy(spec: AutoCompactSpec | None, served: ServedModel) -> AutoCompact | None:
    """A session's online compaction policy, checked (400 with the param)."""
    if spec is None:
        return None
    try:
        policy = AutoCompact.of(**spec.model_dump())
    except ValueError as e:
        raise APIError(400, str(e), param="auto_compact") from None
    if policy.max_tokens >= served.max_model_len:
        raise APIError(
            400,
            f"auto_compact.max_tokens={policy.max_tokens} must be below the model's context "
            f"({served.max_model_len})",
            param="auto_compact",
        )
    if policy.spec.budgets == "measured" and served.budget_schedule is None:
        raise APIError(
            400,
            f"model {served.name!r} has no measured budget schedule (auto_compact.budgets)",
            param="auto_compact",
        )
    return policy


router = APIRouter()
# OpenAPI links from a created session to what can be done with it (API fuzzers follow them).
LINKS = {
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


@router.post(
    "/v1/sessions",
    status_code=201,
    operation_id="create_session",
    responses={**SESSION_ERROR_RESPONSES, 201: {"description": "the session", "links": LINKS}},
)
async def create_session(req: SessionCreateRequest, state: State) -> JSONResponse:
    store, service = state.sessions, state.session_service
    served = state.get(req.model)
    if served.is_diffusion:
        raise APIError(400, "sessions are for autoregressive models", param="model")
    # Stored whole as the session's cache: it must leave the context room to go on.
    ids = [] if req.prompt is None else planning.checked_prompt(served, req.prompt, stored="prompt")
    policy = auto_compact_policy(req.auto_compact, served)
    try:
        store.check_room(len(ids) * bytes_per_token(served))
        session = await asyncio.to_thread(store.create, req.model, req.id)
        session.auto_compact = policy
    except SessionError as e:
        raise session_error(e) from None
    except MirrorError as e:
        raise tier_error(e) from None

    async def build() -> None:
        # Committed, or (never committed) removed whole: as if it had never been.
        async with opened(state, session, write=True):
            if ids:
                await planning.prefill_session(served, session, ids)
        after_append(state, served, session)
        await spill(service)

    await unstoppable(build())
    return JSONResponse(session.describe(), status_code=201)


# response_model=None here and below: FastAPI would make a response model of each return
# annotation (changing the OpenAPI document and checking bodies against it).
@router.get(
    "/v1/sessions", operation_id="list_sessions", responses=ERROR_RESPONSES, response_model=None
)
async def list_sessions(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [s.describe() for s in state.sessions.all()]}


@router.get(
    "/v1/sessions/{sid}", operation_id="get_session", responses=ERROR_RESPONSES, response_model=None
)
async def get_session(sid: str, state: State) -> dict[str, Any]:
    session = await find(state, sid)
    await catch_up(state.session_service, session)
    return session.describe()


@router.delete(
    "/v1/sessions/{sid}",
    operation_id="delete_session",
    responses=ERROR_RESPONSES,
    response_model=None,
)
async def delete_session(sid: str, state: State) -> dict[str, Any]:
    session = await find(state, sid)
    await remove(state.session_service, session, state.settings.session_lock_wait)
    return {"id": sid, "object": "session.deleted", "deleted": True}


@router.post(
    "/v1/sessions/{sid}/compact",
    operation_id="compact_session",
    responses=SESSION_ERROR_RESPONSES,
    response_model=None,
)
async def compact_session(sid: str, req: CompactRequest, state: State) -> dict[str, Any]:
    session = await find(state, sid)
    served = model_for(state, session)
    spec = compaction_spec(req)
    async with state.compactions.slot():
        body = await unstoppable(compact(state, served, session, spec))
    return {"id": sid, "object": "session.compaction", **body, "session": session.describe()}
