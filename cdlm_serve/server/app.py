"""The FastAPI application: routes, middleware, and the state of the models it serves."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from cdlm_serve.engine.sessions import SessionMirror, SessionStore
from cdlm_serve.models.fetch import serve_home
from cdlm_serve.server import response_retention
from cdlm_serve.server.errors import install_error_handlers
from cdlm_serve.server.request_context import RequestContext
from cdlm_serve.server.request_limits import BodySizeLimit
from cdlm_serve.server.routes import ROUTERS, VERSION
from cdlm_serve.server.state import ServerSettings, ServerState

log = logging.getLogger(__name__)


def _document_models(app: FastAPI, names: list[str]) -> None:
    """The OpenAPI schema lists the served model names for every request's `model` (clients
    and API fuzzers then know what exists; any other name answers 404)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        components = schema.get("components", {}).get("schemas", {})
        for name in (
            "CompletionRequest",
            "ChatCompletionRequest",
            "SessionCreateRequest",
            "ResponseCreateRequest",
            "ResponseCompactRequest",
        ):
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
    state.metrics.add_prefix_cache_counters(state.prefix_caches)
    state.metrics.add_session_gauges(
        lambda: (
            len(store.ids()),
            store.memory_bytes(),
            store.disk_bytes(),
            store.max_disk_bytes or 0,
        ),
        lambda: dict(store.write_failures),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(
            target=loader or ServerState.load_all, args=(state,), name="model-loader", daemon=True
        )
        thread.start()
        retention = asyncio.create_task(response_retention.run(state))
        yield
        retention.cancel()
        await asyncio.get_running_loop().run_in_executor(None, state.shutdown)

    app = FastAPI(title="cdlm-serve", version=VERSION, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Outermost (added last): counts every answer, the 401s and 413s too.
    app.add_middleware(RequestContext, api_key=settings.api_key, count=state.metrics.count_http)

    for router in ROUTERS:
        app.include_router(router)
    _document_models(app, [spec.name for spec in settings.models])
    return app
