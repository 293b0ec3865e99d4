"""Bounds on what one request may ask for, checked where the request enters.

The body size is checked by an ASGI middleware before anything parses it: a declared
Content-Length over the limit is answered 413 at once, and a body that turns out longer while it
streams in is cut off with 413 too. The per-field bounds (prompts per request, choices, stop
strings, seeds) live in `server.schemas`; these are their numbers.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cdlm_serve.server.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_PROMPTS = 64  # prompts in one completions request (a list of strings or of id lists)
MAX_CHOICES = 64  # prompts x n: every choice is a sequence in the engine's queue
MAX_CHOICES_LISTED = 1024  # strings one guided_choice may list
MAX_LOGIT_BIAS = 1024  # tokens one logit_bias may name: each is one indexed add a step
MAX_STOP_CHARS = 256  # per stop string: the engine searches every new token's text for them
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, like OpenAI's
# Diffusion `steps` (each one forward pass); also at most the answer length (server.planning).
MAX_DLM_STEPS = 8192


class BodySizeLimit:
    """413 for request bodies over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes HTTPExceptions raised while reading the body through to
                    # the handler that renders OpenAI's error shape.
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)
