"""Shared fixtures: tiny checkpoints, the real default model, and real server processes."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

import tiny_models

if TYPE_CHECKING:
    from cdlm_serve.server.state import ServerState

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_models.hf_tiny("llama", folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_4k_dir(tmp_path_factory) -> Path:
    """The tiny model with a 4K context: a prompt that shows tools is ~1K byte tokens."""
    folder = tmp_path_factory.mktemp("tiny-llama-4k")
    tiny_models.hf_tiny("llama", folder, max_position_embeddings=4096)
    return folder


@pytest.fixture(scope="session")
def tiny_ar_engine(tiny_llama_dir):
    """An AR engine of the tiny model (fp32, CPU, a 512-token context), driven by the test."""
    from cdlm_serve.engine.decoding import AREngine
    from cdlm_serve.models.loading import load_model

    return AREngine(load_model(tiny_llama_dir)[0], tiny_models.byte_tokenizer(), 512)


@pytest.fixture(scope="module", params=["dream", "llada"])
def tiny_dlm_engine(request, tmp_path_factory):
    """A diffusion engine on a tiny random Dream-, then LLaDA-format model (fp32, CPU)."""
    from cdlm_serve.engine.decoding.dlm_engine import DLMEngine
    from cdlm_serve.models.loading import load_model

    folder = tmp_path_factory.mktemp(request.param)
    {"dream": tiny_models.dream_tiny, "llada": tiny_models.llada_tiny}[request.param](folder)
    model, _ = load_model(folder)
    return DLMEngine(model, tiny_models.byte_tokenizer(), max_model_len=512)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, fetched and converted once (shared with the user's cache)."""
    from cdlm_serve.models.fetch import ensure_model

    return ensure_model()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def app_in_thread(app, healthy_within: float | None = 120.0) -> Iterator[str]:
    """Serve an ASGI `app` with uvicorn on a free 127.0.0.1 port in a thread of this process
    (its state stays reachable from the test); yields the base URL once /health answers 200
    (within `healthy_within` seconds), or, with None, once it accepts connections at all (a
    server still loading answers 503). Shuts the server down on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(base, thread, healthy_within)
        yield base
    finally:
        server.should_exit = True
        thread.join(30)


def _wait_until_serving(base: str, thread: threading.Thread, healthy_within: float | None) -> None:
    """Return once `base`/health answers 200 (within `healthy_within` s), or anything at all
    (None: within 5 s); else fail here, saying what it answered, rather than hand a test a
    server that is not there (its first request would fail with a less useful error)."""
    limit = 5.0 if healthy_within is None else healthy_within
    deadline = time.monotonic() + limit
    last = "nothing"
    while time.monotonic() < deadline and thread.is_alive():
        try:
            health = httpx.get(f"{base}/health", timeout=2)
        except httpx.HTTPError as e:
            last = type(e).__name__
        else:
            if healthy_within is None or health.status_code == 200:
                return
            last = f"{health.status_code} {health.text[:300]}"
            if _load_failed(health):  # no use waiting
                break
        time.sleep(0.05)
    wanted = "answer at all" if healthy_within is None else "answer 200"
    stopped = "" if thread.is_alive() else " (the server thread stopped)"
    raise RuntimeError(f"{base}/health did not {wanted} within {limit} s{stopped}; last: {last}")


def _load_failed(health: httpx.Response) -> bool:
    """/health says the models failed to load (`{"status": "error", ...}`)."""
    try:
        return health.json().get("status") == "error"
    except ValueError:  # not JSON: not our server's answer
        return False


@contextmanager
def tiny_app_server(
    model_dir: Path, sessions_dir: Path, **settings: Any
) -> Iterator[tuple[str, ServerState]]:
    """An in-process server of the tiny model `tiny` (fp32, CPU) keeping its sessions in
    `sessions_dir`, with more `ServerSettings`; yields (its URL, its state): in-process, a
    test reaches what the server holds (a session's lock, its settings)."""
    import torch

    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ModelSpec, ServerSettings

    config = ServerSettings(
        [ModelSpec("tiny", str(model_dir))],
        torch.device("cpu"),
        torch.float32,
        sessions_dir=sessions_dir,
        **settings,
    )
    app = create_app(config)
    with app_in_thread(app) as base:
        yield base, app.state.server


def json_schema_spellings(schema: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The request fields that each ask for answers under `schema`, as clients spell them:
    OpenAI's response_format, vLLM's guided_json and its structured_outputs (as JSON text)."""
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    return [
        {"response_format": response_format},
        {"guided_json": schema},
        {"structured_outputs": {"json": json.dumps(schema)}},
    ]


def tree_snapshot(folder: Path, but: Path | None = None) -> dict[str, tuple]:
    """Everything under `folder`, recursively (links not followed; what is inside `but` left
    out), by relative path: a folder as ("dir",), a link with its target, a file with its
    size, mtime and content hash. Equal snapshots: nothing there was written, added, removed
    or re-pointed."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        if but is not None and Path(dirpath) == but:
            dirnames.clear()
            filenames.clear()
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir",)
            else:
                stat = path.stat()
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[rel] = ("file", stat.st_size, stat.st_mtime_ns, digest)
    return out


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture(scope="session", autouse=True)
def users_sessions_untouched():
    """No test writes into the user's real session store (servers get a temporary one)."""
    from cdlm_serve.models.fetch import serve_home

    real = serve_home() / "sessions"
    before = _listing(real)
    yield
    assert _listing(real) == before, f"tests changed {real}"


@contextmanager
def running_server(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> Iterator[str]:
    """Start `cdlm-serve serve ARGS` on a free port; yield its base URL once /health is 200.
    Without --sessions-dir, the server's sessions go to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="cdlm-sessions-") as scratch:
        if "--sessions-dir" not in args:
            args = (*args, "--sessions-dir", scratch)
        with server_process(args, env, timeout) as (base, _):
            yield base


@pytest.fixture(scope="session")
def default_server(smollm2_dir) -> Iterator[str]:
    """`cdlm-serve` with no --model: the default models, as a new user starts it (shared by
    the modules that need it: starting it costs ~30 s)."""
    with running_server() as base:
        yield base


@pytest.fixture(scope="session")
def tiny_ar_and_dlm_server(tmp_path_factory, tiny_llama_4k_dir) -> Iterator[str]:
    """The tiny AR model `tiny` (with a 4K context, for tools) and a tiny Dream model `dream`
    on one server (fp32, CPU): the request options of one kind of model that the other must
    refuse."""
    llama, dream = tiny_llama_4k_dir, tmp_path_factory.mktemp("dream")
    tiny_models.dream_tiny(dream)
    with running_server(
        "--model", f"tiny={llama}", "--model", f"dream={dream}",
        "--device", "cpu", "--dtype", "float32",
    ) as base:  # fmt: skip
        yield base


def series_sum(base: str, name: str, *labels: str) -> float:
    """The sum over the server's /metrics series `name` whose labels contain all `labels`."""
    text = httpx.get(f"{base}/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return sum(float(ln.split()[-1]) for ln in lines if all(lb in ln for lb in labels))


def tiny_session_server(model_dir: Path, sessions_dir: Path, *extra: str):
    """A server of the tiny model `tiny` (fp32, CPU) keeping its sessions in `sessions_dir`."""
    return running_server(
        "--model",
        f"tiny={model_dir}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--sessions-dir",
        str(sessions_dir),
        *extra,
    )


@contextmanager
def server_process(
    args: tuple[str, ...], env: dict[str, str] | None = None, timeout: float = 300
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `cdlm-serve serve ARGS` on a free port; yield (its base URL, its process) once
    /health is 200 (for tests that kill it)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cdlm_serve.server.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                health = httpx.get(f"{base}/health", timeout=2)
                if health.status_code == 200:
                    break
                if health.json().get("status") == "error":  # loading failed: no use waiting
                    raise RuntimeError(f"server failed to load: {health.text}")
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_prometheus(binary: str, config: str, folder: Path) -> Iterator[str]:
    """A real Prometheus with `config` (YAML text), its data in `folder`, on a free port;
    yields its query API's URL (it may still be starting: callers poll)."""
    port = free_port()
    (folder / "prometheus.yml").write_text(config)
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}/api/v1/query"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def outputs_by_request(engine, seqs, abort_after: dict[str, int] | None = None):
    """Run `seqs` together on `engine` (AR or DLM) to the end (bounded: a regression fails, it
    does not hang); each request's outputs in order. `abort_after[id] = n`: its client goes
    away once the engine has taken n steps."""
    abort_after = abort_after or {}
    steps_done = [0]
    for seq in seqs:
        if seq.id in abort_after:
            seq.aborted = lambda n=abort_after[seq.id]: steps_done[0] >= n
        engine.add(seq)
    outs: dict[str, list] = {seq.id: [] for seq in seqs}
    while engine.has_work() and steps_done[0] < 200:
        for out in engine.step():
            outs[out.request_id].append(out)
        steps_done[0] += 1
    assert not engine.has_work()
    return outs
