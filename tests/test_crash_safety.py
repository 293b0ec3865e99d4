"""Sessions survive SIGKILL at any moment: a real server is killed again and again while a
client creates, continues, compacts and deletes sessions; after each restart every session the
server acknowledged is there, in the state it was acknowledged in (or the state of the one
request in flight at the kill), and answers exactly as before.

Half of the rounds kill at a random moment, the other half the moment a write is seen in
progress (a temporary file in the store), so kills land inside `persist` for sure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import tiny_models
from conftest import REPO, free_port

ROUNDS = 30
DEADLINE_S = 600.0  # the loop is bounded in time; 30 rounds take ~4-5 minutes here
MAX_SESSIONS = 6
PEEK = {"prompt": "Q:", "max_tokens": 6, "temperature": 0, "append": False}


@dataclass
class Known:
    """A session's last acknowledged state and, when known, its greedy answer to PEEK."""

    tokens: int
    compactions: int
    answer: str | None = None


@dataclass
class InFlight:
    """The one request the client had sent and not yet seen answered."""

    sid: str
    kind: str  # create | append | compact | delete


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # Wider than the other tests' tiny model, so a session's files take a few ms to write.
    folder = tmp_path_factory.mktemp("crash-model")
    tiny_models.hf_tiny(
        "llama",
        folder,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    return folder


def _start(model_dir: Path, store: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", "--model", f"tiny={model_dir}"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--sessions-dir", str(store)]
    cmd += ["--session-memory-mb", "1"]  # spill to disk all the time, too
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError("server did not start")


def _peek(base: str, sid: str) -> str:
    r = httpx.post(
        f"{base}/v1/completions", json={"model": "tiny", "session_id": sid, **PEEK}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _interrupted_writes(store: Path) -> int:
    """Traces a killed write leaves: temporary files, segments meta.json does not name,
    folders without meta.json."""
    traces = 0
    for folder in store.iterdir():
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        files = {p.name for p in folder.iterdir()}
        traces += sum(name.endswith(".tmp") for name in files)
        if "meta.json" not in files:
            traces += 1
            continue
        named = {s["file"] for s in json.loads((folder / "meta.json").read_text())["segments"]}
        traces += len({f for f in files if f.endswith(".safetensors")} - named)
    return traces


class Client(threading.Thread):
    """Sends one request at a time until the server dies, keeping the ledger up to date."""

    def __init__(self, base: str, known: dict[str, Known], rng: random.Random, serial: int):
        super().__init__(daemon=True)
        self.base, self.known, self.rng, self.serial = base, known, rng, serial
        self.in_flight: InFlight | None = None
        self.http = httpx.Client(base_url=base, timeout=60)

    def run(self) -> None:
        try:
            while True:
                self.step()
        except httpx.HTTPError:  # the server was killed
            pass

    def step(self) -> None:
        rng, known = self.rng, self.known
        ids = sorted(known)
        choices = ["create"] if len(ids) < 3 else []
        if ids:
            choices += ["append", "append", "compact"]
        if len(ids) >= MAX_SESSIONS - 1:
            choices.append("delete")
        if len(ids) < MAX_SESSIONS:
            choices.append("create")
        kind = rng.choice(choices)
        if kind == "create":
            self.serial += 1
            sid = f"s{self.serial}"
            prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(120, 400)))
            self.in_flight = InFlight(sid, kind)
            r = self.http.post("/v1/sessions", json={"model": "tiny", "id": sid, "prompt": prompt})
            assert r.status_code == 201, r.text
            known[sid] = Known(r.json()["tokens"], 0)
        else:
            sid = rng.choice(ids)
            self.in_flight = InFlight(sid, kind)
            if kind == "append":
                body = {"model": "tiny", "session_id": sid, "prompt": "More:", "max_tokens": 8}
                r = self.http.post("/v1/completions", json={**body, "temperature": 0})
            elif kind == "compact":
                body = {"ratio": 2, "method": "am-highest", "keep_recent": 8}
                r = self.http.post(f"/v1/sessions/{sid}/compact", json=body)
            else:
                r = self.http.delete(f"/v1/sessions/{sid}")
            if kind == "compact" and r.status_code == 400:  # too small to compact: no change
                self.in_flight = None
                return
            assert r.status_code == 200, r.text
            if kind == "delete":
                del known[sid]
                self.in_flight = None
                return
            info = self.http.get(f"/v1/sessions/{sid}").json()
            known[sid] = Known(info["tokens"], len(info["compactions"]))
        self.in_flight = None
        known[sid].answer = _peek(self.base, sid)


def _write_in_progress(store: Path) -> bool:
    for folder in os.scandir(store):
        try:
            if any(f.name.endswith(".tmp") for f in os.scandir(folder.path)):
                return True
        except (FileNotFoundError, NotADirectoryError):  # deleted meanwhile
            pass
    return False


def _kill_when(proc: subprocess.Popen, store: Path, mode: str, rng: random.Random) -> None:
    if mode == "random":
        time.sleep(rng.uniform(0.2, 2.5))
    else:  # the moment a write is in progress (or after 4 s, whatever comes first)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            if _write_in_progress(store):
                break
            time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _check(base: str, known: dict[str, Known], flight: InFlight | None) -> int:
    """Every acknowledged session is there as acknowledged (or as the request in flight left
    it) and answers as before; returns how many were lost (the test fails on any)."""
    listed = {s["id"]: s for s in httpx.get(f"{base}/v1/sessions").json()["data"]}
    lost = 0
    if flight is not None and flight.kind == "create" and flight.sid in listed:
        known[flight.sid] = Known(listed[flight.sid]["tokens"], 0)  # done, not yet answered
    assert set(listed) <= set(known), f"sessions nobody acknowledged: {set(listed) - set(known)}"
    for sid, k in list(known.items()):
        moved = flight is not None and flight.sid == sid
        if sid not in listed:
            if moved and flight.kind == "delete":
                del known[sid]
                continue
            lost += 1
            continue
        info = listed[sid]
        state = (info["tokens"], len(info["compactions"]))
        if state == (k.tokens, k.compactions) and k.answer is not None:
            assert _peek(base, sid) == k.answer, f"{sid} answers differently after the restart"
            continue
        if state != (k.tokens, k.compactions):
            assert moved, f"{sid} changed without a request: {state} vs {k}"
            if flight.kind == "append":
                assert info["tokens"] > k.tokens and state[1] == k.compactions
            else:
                assert flight.kind == "compact" and state == (k.tokens, k.compactions + 1)
        known[sid] = Known(*state, answer=_peek(base, sid))  # the new reference
    return lost


def test_sigkill_at_any_moment_loses_no_acknowledged_session(model_dir, tmp_path):
    store, log = tmp_path / "sessions", tmp_path / "server.log"
    store.mkdir()
    rng = random.Random(1234)
    known: dict[str, Known] = {}
    flight: InFlight | None = None
    rounds = kills_in_write = lost = serial = 0
    started = time.monotonic()
    while rounds < ROUNDS and time.monotonic() - started < DEADLINE_S:
        proc, base = _start(model_dir, store, log)
        try:
            lost += _check(base, known, flight)
            client = Client(base, known, random.Random(rng.random()), serial)
            client.start()
            _kill_when(proc, store, "random" if rounds % 2 else "in-write", rng)
            client.join(60)
            flight, serial = client.in_flight, client.serial
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kills_in_write += _interrupted_writes(store) > 0
        rounds += 1
    proc, base = _start(model_dir, store, log)  # the last kill is checked too
    try:
        lost += _check(base, known, flight)
        assert not _interrupted_writes(store), "start-up left an interrupted write behind"
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    print(
        f"\ncrash loop: {rounds} rounds in {time.monotonic() - started:.0f} s, "
        f"{kills_in_write} kills during a write, {lost} sessions lost, "
        f"{len(known)} sessions at the end"
    )
    assert rounds >= ROUNDS, f"only {rounds} rounds in {DEADLINE_S} s"
    assert lost == 0
    assert "not loading" not in text, text[-2000:]  # no session was found corrupt
    assert kills_in_write >= ROUNDS // 4, "too few kills landed inside a write to prove much"
    assert os.listdir(store)  # sessions were really made
