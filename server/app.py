"""The FastAPI application: routes, middleware, and the state of the models it serves."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.session_mirror import SessionMirror
from engine.session_store import SessionStore
from models.fetch import serve_home
from server import chat, completions, planning, sessions_api, streaming
from server.errors import error_body, install_error_handlers
from server.metrics import CONTENT_TYPE
from server.request_context import RequestContext, session_from_header
from server.request_limits import BodySizeLimit
from server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from server.state import ServerSettings, ServerState

log = logging.getLogger(__name__)

VERSION = "0.1.0"


def _document_models(app: FastAPI, names: list[str]) -> None:
    """The OpenAPI schema lists the served model names for every request's `model` (clients
    and API fuzzers then know what exists; any other name answers 404)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        components = schema.get("components", {}).get("schemas", {})
        for name in ("CompletionRequest", "ChatCompletionRequest", "SessionCreateRequest"):
            if name in components:
                components[name]["properties"]["model"]["enum"] = names
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: ServerSettings, loader: Callable[[ServerState], None] | None = None
) -> FastAPI:
    store = SessionStore(
        settings.sessions_dir or serve_home() / "sessions",
        settings.session_memory_bytes,
        settings.max_sessions,
        settings.sessions_disk_bytes,
        SessionMirror(settings.sessions_redis) if settings.sessions_redis else None,
    )
    state = ServerState(settings, store)
    state.metrics.add_gauges(state.gauges)
    state.metrics.add_session_gauges(
        lambda: (
            len(store.ids()),
            store.memory_bytes(),
            store.disk_bytes(),
            store.max_disk_bytes or 0,
        )
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        thread = threading.Thread(
            target=loader or ServerState.load_all, args=(state,), name="model-loader", daemon=True
        )
        thread.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.shutdown)

    app = FastAPI(title="cdlm-serve", version=VERSION, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Outermost (added last): counts every answer, the 401s and 413s too.
    app.add_middleware(RequestContext, api_key=settings.api_key, count=state.metrics.count_http)
    errors = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}

    @app.get("/health")
    def health() -> JSONResponse:
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.load_error is not None:
            body = {"status": "error", **error_body(503, state.load_error)}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=errors)
    def list_models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": m.name,
                    "object": "model",
                    "created": m.created,
                    "owned_by": "cdlm-serve",
                    "max_model_len": m.max_model_len,
                }
                for m in state.models.values()
            ],
        }

    sessions_api.install(app, state, errors)
    _document_models(app, [spec.name for spec in settings.models])

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**errors, 409: errors[400], 507: errors[400]},
        operation_id="create_completion",
    )
    async def create_completion(req: CompletionRequest, request: Request):
        served = state.get(req.model)
        req.session_id = session_from_header(request, req.session_id)
        if req.session_id is not None:
            return await sessions_api.continue_session(state, served, req, request)
        choices = planning.plan_completion(served, req)
        if req.stream:
            return StreamingResponse(
                completions.stream(served, req, choices, state.metrics),
                media_type="text/event-stream",
            )
        # Returned as built (the response_model documents the shape): usage.steps is present
        # for diffusion models only, and logprobs is an explicit null.
        body = await streaming.until_disconnected(
            request, completions.complete(served, req, choices, state.metrics)
        )
        return JSONResponse(body)

    @app.post("/v1/chat/completions", responses=errors)
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        served = state.get(req.model)
        choices = chat.plan_chat(served, req)
        if req.stream:
            return StreamingResponse(
                chat.stream(served, req, choices, state.metrics), media_type="text/event-stream"
            )
        body = await streaming.until_disconnected(
            request, chat.complete(served, req, choices, state.metrics)
        )
        return JSONResponse(body)

    return app
