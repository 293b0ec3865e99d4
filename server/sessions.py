"""The sessions API: create, inspect, delete, compact; and completions that continue from a
session's cache.

Model work (prefilling a session's prompt, compacting) runs on the model's engine thread between
decode steps (`BatchWorker.call`): it shares the model with the requests being decoded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.compactor import compact_row
from engine.served_model import ServedModel
from engine.sessions import Session, SessionError
from server.errors import APIError
from server.schemas import CompactRequest, SessionCreateRequest

if TYPE_CHECKING:
    from server.app import ServerState


def find(state: ServerState, sid: str) -> Session:
    session = state.sessions.get(sid)
    if session is None:
        raise APIError(
            404, f"session {sid!r} does not exist", param="session_id", code="session_not_found"
        )
    return session


def model_for(state: ServerState, session: Session) -> ServedModel:
    served = state.get(session.model)
    if served.is_diffusion:
        raise APIError(400, "sessions are for autoregressive models", param="model")
    return served


@asynccontextmanager
async def locked(session: Session, wait: float = 10.0) -> AsyncIterator[None]:
    """Hold the session's lock; 409 if it stays busy for `wait` seconds."""
    got = await asyncio.to_thread(session.lock.acquire, True, wait)
    if not got:
        raise APIError(
            409,
            f"session {session.id!r} is busy (a compaction or a completion is running); try again",
            param="session_id",
            code="session_busy",
        )
    try:
        yield
    finally:
        session.lock.release()


async def load_cache(state: ServerState, served: ServedModel, session: Session) -> None:
    """Bring a spilled session's cache back into memory (hold its lock)."""
    await asyncio.to_thread(state.sessions.load, session, served.model.device, served.model.dtype)


def install(app: FastAPI, state: ServerState, errors: dict) -> None:
    @app.post("/v1/sessions", status_code=201, responses=errors)
    async def create_session(req: SessionCreateRequest):
        served = state.get(req.model)
        if served.is_diffusion:
            raise APIError(400, "sessions are for autoregressive models", param="model")
        ids: list[int] = []
        if req.prompt is not None:
            ids = served.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
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
            session = state.sessions.create(req.model, req.id)
        except SessionError as e:
            status = 409 if "already exists" in str(e) else 400
            raise APIError(status, str(e), param="id") from None
        if ids:
            async with locked(session, state.settings.session_lock_wait):
                session.cache = await served.worker.call(lambda: prefill(served, ids))
                session.tokens = ids
                await asyncio.to_thread(state.sessions.persist, session)
        state.sessions.enforce_limit()
        return JSONResponse(session.describe(), status_code=201)

    @app.get("/v1/sessions/{sid}", responses=errors)
    async def get_session(sid: str):
        return find(state, sid).describe()

    @app.delete("/v1/sessions/{sid}", responses=errors)
    async def delete_session(sid: str):
        session = find(state, sid)
        async with locked(session, state.settings.session_lock_wait):
            state.sessions.delete(sid)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{sid}/compact", responses=errors)
    async def compact_session(sid: str, req: CompactRequest):
        session = find(state, sid)
        served = model_for(state, session)
        if (req.ratio is None) == (req.target_tokens is None):
            raise APIError(400, "give exactly one of ratio and target_tokens", param="ratio")
        async with locked(session, state.settings.session_lock_wait):
            await load_cache(state, served, session)
            cache = session.cache
            if cache is None or cache.lengths[0] == 0:
                raise APIError(400, "the session's cache is empty", param="session_id")
            region = cache.lengths[0] - req.keep_recent
            if region < 1:
                raise APIError(
                    400,
                    f"keep_recent={req.keep_recent} leaves nothing of the "
                    f"{cache.lengths[0]} cached tokens to compact",
                    param="keep_recent",
                )
            target = req.target_tokens or max(1, math.ceil(region / req.ratio))
            if target > region:
                raise APIError(
                    400,
                    f"target_tokens={target} is larger than the {region} tokens to compact",
                    param="target_tokens",
                )
            history = list(session.tokens)
            report = await served.worker.call(
                lambda: compact_row(
                    served.model,
                    served.tokenizer,
                    cache,
                    0,
                    history,
                    target,
                    req.method,
                    req.query_source,
                    req.keep_recent,
                )
            )
            body = report.to_dict()
            session.compactions.append(body)
            await asyncio.to_thread(state.sessions.persist, session)
        state.metrics.compaction_seconds.labels(req.method).observe(report.seconds["total"])
        state.metrics.compaction_ratio.labels(req.method).observe(report.ratio)
        return {"id": sid, "object": "session.compaction", **body, "session": session.describe()}


@torch.no_grad()
def prefill(served: ServedModel, ids: list[int]):
    """A fresh batch-1 cache holding `ids` (runs on the engine thread)."""
    cache = served.model.new_cache(1, len(ids) + 64)
    served.model(torch.tensor([ids], device=served.model.device), cache=cache)
    return cache
