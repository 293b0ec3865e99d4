"""The FastAPI application: routes, middleware, and the state of the models it serves."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core_share import CoreShare
from engine.served_model import ServedModel, load_served_model
from engine.session_mirror import SessionMirror
from engine.session_store import SessionStore
from models.fetch import serve_home
from server import chat, completions, planning, sessions_api, streaming
from server.compactions import Compactions
from server.errors import APIError, error_body, install_error_handlers
from server.metrics import CONTENT_TYPE, Metrics
from server.request_context import RequestContext, session_from_header
from server.request_limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)

log = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass(slots=True)
class ModelSpec:
    name: str
    source: str


@dataclass(slots=True)
class ServerSettings:
    models: list[ModelSpec]
    device: torch.device
    dtype: torch.dtype
    max_model_len: int | None = None
    max_queue: int = 256
    max_batch: int = 8  # sequences decoded together per model
    prefill_tokens: int | None = None  # prompt tokens per step (chunked prefill); None: auto
    api_key: str | None = None
    sessions_dir: Path | None = None  # default: $CDLM_SERVE_HOME/sessions
    session_memory_bytes: int = 2 << 30
    session_lock_wait: float = 10.0  # seconds a busy session is waited for before 409
    max_sessions: int = 1024
    sessions_disk_bytes: int | None = 20 << 30  # None: no quota
    sessions_redis: str | None = None  # redis://host:port/db of the shared session tier
    compaction_omp_budget: float = 60.0  # seconds of exact OMP per compaction (then faster)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a real key, or no key to turn auth off")


@dataclass(slots=True)
class ServerState:
    """Models load in the background, so /health can say 503 while they do."""

    settings: ServerSettings
    sessions: SessionStore
    metrics: Metrics = field(default_factory=Metrics)
    # The cores, split among the threads with work (engine threads, the compaction thread).
    cores: CoreShare = field(default_factory=CoreShare.shared)
    compactions: Compactions = field(init=False)
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None

    def __post_init__(self) -> None:
        self.compactions = Compactions(self.cores)

    def load_all(self) -> None:
        log.info(
            "loading %d model(s); /health answers 503 until they are ready",
            len(self.settings.models),
        )
        try:
            for spec in self.settings.models:
                s = self.settings
                self.models[spec.name] = load_served_model(
                    spec.name,
                    spec.source,
                    s.device,
                    s.dtype,
                    s.max_model_len,
                    s.max_queue,
                    s.max_batch,
                    self.metrics,
                    s.prefill_tokens,
                    self.cores,
                )
        except Exception as e:  # reported by /health; the process stays up to say so
            log.exception("model loading failed")
            self.load_error = f"{type(e).__name__}: {e}"
        else:
            log.info("ready: serving %s (/health answers 200)", ", ".join(self.models))
        finally:
            self.ready.set()

    def get(self, name: str) -> ServedModel:
        if not self.ready.is_set():
            raise APIError(503, "models are still loading", headers={"Retry-After": "5"})
        served = self.models.get(name)
        if served is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise APIError(
                404,
                f"model {name!r} does not exist (served: {known})",
                param="model",
                code="model_not_found",
            )
        if served.thread.full():  # checked before a stream starts: its 429 must be a status
            raise APIError(
                429,
                f"{name}: {served.thread.waiting} requests are already waiting",
                headers={"Retry-After": "1"},
            )
        return served

    def gauges(self) -> dict[str, tuple[int, int, float]]:
        """model -> (running, waiting, KV cache usage), read at scrape time."""
        out = {}
        for name, served in self.models.items():
            out[name] = (served.thread.running, served.thread.waiting, served.engine.kv_usage())
        return out

    def shutdown(self) -> None:
        """Let in-flight requests finish, stop the engine threads, write sessions to disk."""
        for served in self.models.values():
            served.thread.shutdown(timeout=60)
        self.compactions.shutdown()
        self.sessions.persist_all()


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
