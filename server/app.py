"""The FastAPI application: routes, and the state of the models it serves."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.served_model import ServedModel, load_served_model
from server import completions
from server.errors import APIError, error_body, install_error_handlers
from server.metrics import CONTENT_TYPE, Metrics
from server.schemas import CompletionRequest, CompletionResponse, ErrorResponse, ModelList

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
    max_batch: int = 8  # sequences a diffusion model decodes together


@dataclass(slots=True)
class ServerState:
    """Models load in the background, so /health can say 503 while they do."""

    settings: ServerSettings
    metrics: Metrics = field(default_factory=Metrics)
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None

    def load_all(self) -> None:
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
                )
        except Exception as e:  # reported by /health; the process stays up to say so
            log.exception("model loading failed")
            self.load_error = f"{type(e).__name__}: {e}"
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
        return served

    def shutdown(self) -> None:
        for served in self.models.values():
            served.worker.shutdown(timeout=30)


def create_app(
    settings: ServerSettings, loader: Callable[[ServerState], None] | None = None
) -> FastAPI:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        thread = threading.Thread(
            target=loader or ServerState.load_all, args=(state,), name="model-loader", daemon=True
        )
        thread.start()
        yield
        state.shutdown()

    app = FastAPI(title="cdlm-serve", version=VERSION, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    errors = {code: {"model": ErrorResponse} for code in (400, 404, 429, 503)}

    @app.get("/health")
    def health() -> JSONResponse:
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.load_error is not None:
            body = {"status": "error", **error_body(503, state.load_error)}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
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

    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def create_completion(req: CompletionRequest):
        served = state.get(req.model)
        choices = completions.plan_choices(served, req)
        if req.stream:
            return StreamingResponse(
                completions.stream(served, req, choices, state.metrics),
                media_type="text/event-stream",
            )
        # Returned as built (the response_model documents the shape): usage.steps is present
        # for diffusion models only, and logprobs is an explicit null.
        return JSONResponse(await completions.complete(served, req, choices, state.metrics))

    return app
