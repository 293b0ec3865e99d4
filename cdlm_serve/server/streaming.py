"""Answering over HTTP, for completions and chat alike: server-sent events, the frame every
stream shares (`StreamHead`, `framed`), and cancelling work whose client went away."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server.errors import APIError, error_body
from cdlm_serve.server.metrics import Metrics
from cdlm_serve.server.planning import Choice, UsageCount, new_id, record, usage


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


DISCONNECT_CHECK_SECONDS = 0.1


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts its engine
    sequences) instead of finishing an answer nobody will read."""
    task = asyncio.ensure_future(work)
    while not task.done():
        # A check is one non-blocking look at the connection: cheap enough to free the engine
        # within a tenth of a second of the client leaving.
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_CHECK_SECONDS)
        if not done and await request.is_disconnected():
            task.cancel()
            raise APIError(499, "client closed the request")
    return task.result()


async def answer_when_admitted(events: AsyncGenerator[Any, None], stream: bool) -> Response:
    """The answer of work that yields None once admitted (an error before that is the
    request's error, before any response starts), then its stream's chunks or its one body.
    A body's generator is closed before the answer leaves (its cleanup, a session's commit,
    is done by then)."""
    await anext(events)
    if stream:
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        return JSONResponse(await anext(events))
    finally:
        await events.aclose()


@dataclass(slots=True)
class StreamHead:
    """What every chunk of one stream carries besides its choice."""

    id: str
    object: str  # "text_completion" | "chat.completion.chunk"
    created: int
    model: str
    include_usage: bool  # every chunk says "usage": null, the last one the usage

    @classmethod
    def new(cls, served: ServedModel, req: Any, obj: str, prefix: str) -> StreamHead:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return cls(new_id(prefix), obj, int(time.time()), served.name, include_usage)

    def body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict[str, Any]) -> str:
        body = self.body([choice])
        if self.include_usage:
            body["usage"] = None
        return sse(body)


# A stream's choices as chunks: (model, request, choices, its head, the tally to count into).
Chunks = Callable[[ServedModel, Any, list[Choice], StreamHead, UsageCount], AsyncIterator[str]]


@dataclass(frozen=True, slots=True)
class StreamKind:
    """What differs between the completions and the chat stream."""

    object: str  # every chunk's "object"
    id_prefix: str  # "cmpl", "chatcmpl"
    chunks: Chunks


def stream(
    served: ServedModel,
    req: Any,
    choices: list[Choice],
    metrics: Metrics | None,
    kind: StreamKind,
    before_done: Callable[[], Awaitable[APIError | None]] | None = None,
) -> AsyncIterator[str]:
    """One stream, completions and chat alike: the kind's chunks, then its end (`_framed`)."""
    head = StreamHead.new(served, req, kind.object, kind.id_prefix)
    tally = UsageCount()
    chunks = kind.chunks(served, req, choices, head, tally)
    return _framed(served, req, choices, metrics, head, tally, chunks, before_done)


async def _framed(
    served: ServedModel,
    req: Any,
    choices: list[Choice],
    metrics: Metrics | None,
    head: StreamHead,
    tally: UsageCount,
    chunks: AsyncIterator[str],
    before_done: Callable[[], Awaitable[APIError | None]] | None,
) -> AsyncIterator[str]:
    """A stream's chunks, then its end: an error becomes an error event, usage is counted and
    recorded even when the client goes away (the generator is closed: an abort), then the
    usage chunk if it was asked for, then `before_done()` (a session's commit: the client must
    not hear [DONE] before it; an error it returns becomes an error event), then [DONE]."""
    started = time.perf_counter()
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param, e.code))
    finally:
        body = usage(served, choices, req.n, tally)
        record(metrics, served, body, tally, started, len(choices))
    if head.include_usage:
        yield sse({**head.body([]), "usage": body})
    if before_done is not None:
        error = await before_done()
        if error is not None:
            yield sse(error_body(error.status, error.message, error.param, error.code))
    yield sse("[DONE]")
