"""What the server holds while it runs: its settings, its models (loaded in the background,
so /health can say 503 while they load), the session store, metrics, the core share and the
compaction thread. Every route reads it; it reads none of them."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
from fastapi import Depends, Request

from cdlm_serve.engine.core_share import CoreShare
from cdlm_serve.engine.heap import HeapTrimmer
from cdlm_serve.engine.served_model import ServedModel, load_served_model
from cdlm_serve.engine.sessions import SessionService, SessionStore
from cdlm_serve.server.compaction_thread import Compactions
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.metrics import Metrics
from cdlm_serve.server.request_limits import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)


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
    prefix_cache_bytes: int = 512 << 20  # per AR model (automatic prefix caching); 0: off
    heap_trim_seconds: float = 60.0  # malloc_trim period on CPU (engine.heap); 0: off
    quantize: str | None = None  # "int8": Q8_0 weights (models/quantize.py)
    # A row's answer never depends on its batch, chunking or cache (engine ModelRunner).
    batch_invariant: bool = True
    api_key: str | None = None
    sessions_dir: Path | None = None  # default: $CDLM_SERVE_HOME/sessions
    session_memory_bytes: int = 2 << 30
    session_lock_wait: float = 10.0  # seconds a busy session is waited for before 409
    max_sessions: int = 1024
    responses_ttl: float = 30 * 86400.0  # seconds a stored response is kept; 0: until deleted
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
    # How requests use a session: lock, lease, load, commit or roll back (engine.sessions).
    session_service: SessionService = field(init=False)
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None
    heap: HeapTrimmer = field(init=False)

    def __post_init__(self) -> None:
        self.compactions = Compactions(self.cores)
        self.session_service = SessionService(self.sessions, self.settings.session_lock_wait)
        # Only CPU tensors live in glibc's heap: on CUDA the trims would find little to give.
        cpu = self.settings.device.type == "cpu"
        self.heap = HeapTrimmer(every_s=self.settings.heap_trim_seconds if cpu else 0.0)
        self.metrics.add_heap_metrics(self.heap)

    def load_all(self) -> None:
        log.info(
            "loading %d model(s); /health answers 503 until they are ready",
            len(self.settings.models),
        )
        self.heap.start()  # loading frees its conversion buffers: trimmed too
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
                    s.prefix_cache_bytes,
                    s.quantize,
                    s.batch_invariant,
                )
                # The grammar engine's tokenizer too, so that no request's first structured
                # output holds the event loop while it is built.
                self.models[spec.name].engine.grammars.prepare()
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

    def gauges(self) -> dict[str, tuple[int, int, float, int]]:
        """model -> (running, waiting, KV cache usage, KV cache bytes), read at scrape time."""
        out = {}
        for name, served in self.models.items():
            engine = served.engine
            out[name] = (
                served.thread.running,
                served.thread.waiting,
                engine.kv_usage(),
                engine.kv_bytes(),
            )
        return out

    def prefix_caches(self) -> dict[str, tuple[int, int, int]]:
        """model -> (prompt tokens queried, tokens hit, bytes held) of each model with a
        prefix cache, read at scrape time."""
        out = {}
        for name, served in self.models.items():
            pc = served.engine.prefix_cache
            if pc is not None:
                out[name] = (pc.queries, pc.hits, pc.nbytes)
        return out

    def shutdown(self) -> None:
        """Let in-flight requests finish, stop the engine threads, write sessions to disk."""
        for served in self.models.values():
            served.thread.shutdown(timeout=60)
        self.compactions.shutdown()
        self.sessions.persist_all()
        self.heap.stop()


def current_state(request: Request) -> ServerState:
    """The server's state, for a route (a FastAPI dependency): `create_app` keeps it on the app."""
    state: ServerState = request.app.state.server
    return state


# A route's parameter `state: State` receives the server's state.
State = Annotated[ServerState, Depends(current_state)]
