"""The routes of the OpenAI API and the service's own (health, version, metrics), as module-level
handlers: each gets the server's state as a dependency (`server.state.State`). The sessions
routes are in `server/routes/sessions.py`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server import chat, completions, planning, streaming
from cdlm_serve.server.errors import error_body
from cdlm_serve.server.metrics import CONTENT_TYPE
from cdlm_serve.server.request_context import session_from_header
from cdlm_serve.server.routes import sessions as sessions_api
from cdlm_serve.server.schemas import (
    ERROR_RESPONSES,
    SESSION_ERROR_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from cdlm_serve.server.state import ServerState, State
from cdlm_serve.server.streaming import StreamKind

VERSION = "0.1.0"
router = APIRouter()


@router.get("/health")
def health(state: State) -> JSONResponse:
    if not state.ready.is_set():
        return JSONResponse({"status": "loading"}, status_code=503)
    if state.load_error is not None:
        body = {"status": "error", **error_body(503, state.load_error)}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/version")
def version() -> dict[str, Any]:
    return {"version": VERSION}


@router.get("/metrics")
def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
def list_models(state: State) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": m.name,
                "object": "model",
                "created": m.created,
                "owned_by": "cdlm-serve",
                "max_model_len": m.max_model_len,
                "dtype": str(m.model.dtype).removeprefix("torch."),
            }
            for m in state.models.values()
        ],
    }


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**SESSION_ERROR_RESPONSES, 409: ERROR_RESPONSES[400]},
    operation_id="create_completion",
)
async def create_completion(req: CompletionRequest, request: Request, state: State) -> Response:
    served = state.get(req.model)
    req.session_id = session_from_header(request, req.session_id)
    if req.session_id is not None:
        return await sessions_api.continue_session(state, served, req, request)
    choices = planning.plan_completion(served, req)
    return await _answer(
        request, state, served, req, choices, completions.STREAM, completions.complete
    )


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def create_chat_completion(
    req: ChatCompletionRequest, request: Request, state: State
) -> Response:
    served = state.get(req.model)
    choices = chat.plan_chat(served, req)
    return await _answer(request, state, served, req, choices, chat.STREAM, chat.complete)


async def _answer(
    request: Request,
    state: ServerState,
    served: ServedModel,
    req: Any,
    choices: list[planning.Choice],
    kind: StreamKind,
    complete: Callable[..., Awaitable[dict[str, Any]]],
) -> Response:
    """A planned request's answer: its stream, or `complete`'s body. The body is returned as
    built (the response_model documents the shape): usage.steps is present for diffusion
    models only, and logprobs is an explicit null."""
    if req.stream:
        return StreamingResponse(
            streaming.stream(served, req, choices, state.metrics, kind),
            media_type="text/event-stream",
        )
    body = await streaming.until_disconnected(
        request, complete(served, req, choices, state.metrics)
    )
    return JSONResponse(body)
