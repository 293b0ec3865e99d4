"""What every request gets on its way in: an id, the API key check, and an access-log line.

A pure ASGI middleware, not FastAPI's `@app.middleware("http")`: that one (Starlette's
`BaseHTTPMiddleware`) runs the route in a child task behind memory streams, where
`Request.is_disconnected()` never sees the client leave (a non-streamed completion whose client
hung up decoded to the end), and each of its checks left anyio re-delivering a cancellation at
every turn of the event loop until the request ended: with four non-streamed completions in
flight the event loop used a whole core, taken from the engine threads.
"""

from __future__ import annotations

import contextvars
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cdlm_serve.engine.sessions import SESSION_ID_PATTERN
from cdlm_serve.server.errors import APIError, error_response

log = logging.getLogger("cdlm_serve.server.app")

# With an API key, every path but these needs it (deny by default: a route added later, or a
# path spelled another way, is never open by accident).
OPEN_PATHS = frozenset(
    {"/health", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record (the id of the HTTP request being served)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def _authorized(headers: Headers, api_key: str) -> bool:
    auth = headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    return secrets.compare_digest(given.encode(), api_key.encode())


SESSION_HEADER = "x-session-id"  # what session-aware routers hash (vLLM production-stack too)


def session_from_header(request: Request, body_session: str | None) -> str | None:
    """The session a completion continues: `session_id` in the body or the `X-Session-Id`
    header (both, they must agree), checked by the same rule as the body's."""
    header = request.headers.get(SESSION_HEADER)
    if header is None:
        return body_session
    if not SESSION_ID_RE.fullmatch(header):
        raise APIError(400, f"invalid {SESSION_HEADER} header", param=SESSION_HEADER)
    if body_session is not None and body_session != header:
        raise APIError(
            400, f"session_id and the {SESSION_HEADER} header disagree", param="session_id"
        )
    return header


def _route(scope: Scope) -> str:
    """The matched route's template (`/v1/sessions/{sid}`), never the raw path, so the
    label's values stay few whatever clients send; "-" when no route matched."""
    route = scope.get("route")
    return getattr(route, "path", "-")


class RequestContext:
    """The request's id (its `X-Request-Id`, or a new one) in every log line and on the
    response; 401 without the API key on every path but `OPEN_PATHS`; one log line when the
    response has been sent."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None = None,
        count: Callable[[str, str, int], None] | None = None,
    ):
        self.app = app
        self.api_key = api_key
        self.count = count  # (method, route template, status) of each answered request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        token = REQUEST_ID.set(rid)
        started = time.perf_counter()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message).append("x-request-id", rid)
            await send(message)

        try:
            if (
                self.api_key is not None
                and scope["path"] not in OPEN_PATHS
                and not _authorized(headers, self.api_key)
            ):
                error = APIError(
                    401,
                    "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send_with_id)
                if self.count is not None:
                    self.count(scope["method"], "-", 401)
                return
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:  # answered 500 by the outer error handler: counted as such
                if self.count is not None:
                    self.count(scope["method"], _route(scope), status or 500)
                raise
            if self.count is not None:
                self.count(scope["method"], _route(scope), status)
            log.info(
                "%s %s -> %d in %.3fs",
                scope["method"],
                scope["path"],
                status,
                time.perf_counter() - started,
            )
        finally:
            REQUEST_ID.reset(token)
