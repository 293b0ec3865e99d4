"""Sessions survive SIGKILL at any moment, and what the server acknowledged is durable.

A real server is killed again and again while several clients at once create, continue
(plain and streamed), compact (plain and int8) and delete sessions, some of them compacting
themselves (`auto_compact`). Each client keeps a ledger of what the server
acknowledged, written from each 2xx response itself: the tokens a create or a compaction
reports, an append's tokens from its `usage`; then the digest of the session's committed files
(its tokens and every KV segment's bytes, read from disk). After each restart every
acknowledged session is there with that digest (or in the state the one request in flight at
the kill, or its own online compaction, left it), and the server answers from it as it did
after the last restart that found the same state (answers are compared between restarts, each
peek alone: a peek batched with other rows may flip a near-tied greedy token).

A SIGKILL cannot lose what the kernel already has: it proves the commit protocol's order on
one machine, not its durability on a power cut. So the server also runs with an audit of its
file operations (a `sitecustomize` that notes every fsync and rename, after it is done, in a
log): for every acknowledgement, the log up to the moment the client received it must show the
new meta.json renamed into place after its contents were fsynced, and the session's folder
fsynced after that (the store's root too, for a new or deleted session): what a power cut
would keep. A server that answered before the commit, or skipped a folder's fsync, fails here
at the first acknowledgement, whenever the kills land.

Half of the rounds kill at a random moment, the other half the moment a write is seen in
progress (a temporary file in the store), so kills land inside `persist` for sure.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

import tiny_models
from conftest import REPO, free_port

# 14 rounds in CI (~3 minutes here): the audit fails a broken commit order at the first
# acknowledgement whatever the count; more rounds only land more kills in more places. A soak:
# CDLM_CRASH_ROUNDS=200 pytest tests/test_crash_safety.py (30 rounds took 234 s quiet).
ROUNDS = int(os.environ.get("CDLM_CRASH_ROUNDS", "14"))
CLIENTS = 3
DEADLINE_S = 60.0 * ROUNDS  # the loop is bounded in time
MAX_SESSIONS = 3  # per client
APPEND = {"prompt": "More:", "max_tokens": 8, "temperature": 0}
PEEK = {"prompt": "Q:", "max_tokens": 6, "temperature": 0, "append": False}
AUTO = {"max_tokens": 256, "ratio": 2, "method": "am-highest", "keep_recent": 16}

# Loaded into the server's interpreter (PYTHONPATH) when CDLM_TEST_FS_AUDIT names a log: each
# fsync and rename, once done, as one line appended with one write (so a SIGKILL never leaves
# half a line, and a line is in the log before the server can answer anything after it). Each
# rename first waits RENAME_DELAY_S, as on a slow disk: a server that answered without
# waiting for its commit would almost always win the race against a fast one, unseen.
RENAME_DELAY_S = 0.03
AUDIT_HOOK = f"""
import os
import time

_path = os.environ.get("CDLM_TEST_FS_AUDIT")
if _path:
    _log = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _fsync, _replace, _rename = os.fsync, os.replace, os.rename

    def _note(*words):
        os.write(_log, ("\\t".join(words) + "\\n").encode())

    def fsync(fd):
        number = fd if isinstance(fd, int) else fd.fileno()
        _fsync(fd)
        _note("fsync", os.readlink(f"/proc/self/fd/{{number}}"))

    def replace(src, dst, **kw):
        time.sleep({RENAME_DELAY_S})
        _replace(src, dst, **kw)
        _note("rename", os.path.abspath(src), os.path.abspath(dst))

    def rename(src, dst, **kw):
        time.sleep({RENAME_DELAY_S})
        _rename(src, dst, **kw)
        _note("rename", os.path.abspath(src), os.path.abspath(dst))

    os.fsync, os.replace, os.rename = fsync, replace, rename
"""


@dataclass
class Known:
    """A session's last acknowledged state: its token count and compactions, the digest of
    its committed files (None where the kill came first) and its greedy answer to PEEK as a
    check after a restart gave it (None until one has)."""

    tokens: int
    compactions: int
    auto: bool = False
    # Whether the last token is still to be run (after an append: the last sampled token).
    # The next append's prompt counts it again (`usage.prompt_tokens`), the session once.
    pending: bool = False
    digest: str | None = None
    answer: str | None = None


@dataclass
class InFlight:
    """The one request a client had sent and not yet seen answered."""

    sid: str
    kind: str  # create | append | compact | delete


@dataclass
class Ack:
    """One acknowledged change, and where the server's file audit stood when the request went
    out and when its answer came back."""

    kind: str
    sid: str
    sent: int
    received: int


@dataclass
class Ledger:
    """A client's sessions, carried from round to round."""

    name: str
    known: dict[str, Known] = field(default_factory=dict)
    serial: int = 0
    flight: InFlight | None = None


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


@pytest.fixture(scope="module")
def audit_hook(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("audit-hook")
    (folder / "sitecustomize.py").write_text(AUDIT_HOOK)
    return folder


def _start(
    model_dir: Path, store: Path, log: Path, hook: Path, audit: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cdlm_serve.server.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", "--model", f"tiny={model_dir}"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--sessions-dir", str(store)]
    cmd += ["--session-memory-mb", "1"]  # spill to disk all the time, too
    env = {**os.environ, "CDLM_TEST_FS_AUDIT": str(audit)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("ab")
    )
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


# ---- what is on disk ---------------------------------------------------------------------------
def _committed(folder: Path) -> tuple[dict, str] | None:
    """The committed version of a session folder, and the digest of its tokens and KV (every
    segment's bytes, in order); None if there is none. Read twice around the segments, so a
    version committed meanwhile (a session's own online compaction) is never half read."""
    for _ in range(20):
        try:
            before = (folder / "meta.json").read_bytes()
            meta = json.loads(before)
            h = hashlib.sha256()
            h.update(json.dumps([meta["tokens"], meta["next_input"], meta["logical"]]).encode())
            for seg in meta["segments"]:
                h.update((folder / seg["file"]).read_bytes())
            if (folder / "meta.json").read_bytes() == before:
                return meta, h.hexdigest()
        except FileNotFoundError:
            if not folder.exists():
                return None
        time.sleep(0.01)
    raise AssertionError(f"{folder}: no stable committed version to read")


def _tokens(meta: dict) -> int:
    return len(meta["tokens"]) + (meta["next_input"] is not None)


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


def _write_in_progress(store: Path) -> bool:
    for folder in os.scandir(store):
        try:
            if any(f.name.endswith(".tmp") for f in os.scandir(folder.path)):
                return True
        except (FileNotFoundError, NotADirectoryError):  # deleted meanwhile
            pass
    return False


# ---- the file audit ----------------------------------------------------------------------------
def _audit_lines(audit: Path) -> tuple[list[tuple[str, ...]], list[int]]:
    """The audit's lines as tuples, and each line's end offset in the file."""
    lines, ends, offset = [], [], 0
    for raw in audit.read_bytes().splitlines(keepends=True):
        offset += len(raw)
        lines.append(tuple(raw.decode().rstrip("\n").split("\t")))
        ends.append(offset)
    return lines, ends


def _durable_before(ack: Ack, store: Path, lines: list, ends: list) -> str | None:
    """Why `ack`'s change was not yet durable when the client received it (None if it was):
    what the log shows between the request going out and its answer coming back. (A session's
    own online compaction may commit in that window too; it is fsynced the same way.)"""
    window = [line for line, end in zip(lines, ends, strict=True) if ack.sent < end <= ack.received]
    folder, root = str(store / ack.sid), str(store)
    # Files fsynced before the request went out count: a session's own online compaction may
    # have written and fsynced its segment then, and renames it while this request waits.
    synced = {
        paths[0]
        for (op, *paths), end in zip(lines, ends, strict=True)
        if end <= ack.sent and op == "fsync"
    }
    renamed = durable = root_synced = False  # the commit's rename, and its fsync after it
    for op, *paths in window:
        if op == "fsync":
            synced.add(paths[0])
            if ack.kind == "delete":
                durable |= renamed and paths[0] == root
            else:
                durable |= renamed and paths[0] == folder
                root_synced |= paths[0] == root
            continue
        src, dst = paths
        if ack.kind == "delete":
            renamed |= src == folder and dst.startswith(f"{root}/.trash-{ack.sid}-")
        elif os.path.dirname(dst) == folder:
            if src not in synced:
                return f"{dst} renamed into place before its contents were fsynced"
            renamed |= dst == f"{folder}/meta.json"
    if not renamed:
        return (
            "no commit (meta.json renamed into place, or the folder to the trash) before the answer"
        )
    if not durable:
        where = "store's root" if ack.kind == "delete" else "session's folder"
        return f"the {where} not fsynced after the commit's rename, before the answer"
    if ack.kind == "create" and not root_synced:
        return "the store's root not fsynced after the new session's folder was made"
    return None


# ---- the clients -------------------------------------------------------------------------------
class Client(threading.Thread):
    """Sends one request at a time until the server is killed, keeping its ledger from each
    answer. Any failure other than the kill's transport error is kept for the main thread."""

    def __init__(
        self, base: str, ledger: Ledger, rng: random.Random, store: Path, audit: Path
    ) -> None:
        super().__init__(daemon=True)
        self.ledger, self.rng, self.store, self.audit = ledger, rng, store, audit
        self.http = httpx.Client(base_url=base, timeout=120)
        self.killed = threading.Event()  # set by the main thread just before the SIGKILL
        self.error: str | None = None
        self.acks: list[Ack] = []

    def run(self) -> None:
        try:
            while True:
                self.step()
        except httpx.TransportError as e:
            if not self.killed.is_set():
                self.error = f"transport error before the kill: {e!r}"
        except BaseException as e:  # an assertion, an unexpected answer: the test fails
            import traceback

            self.error = "".join(traceback.format_exception(e))

    def _offset(self) -> int:
        return self.audit.stat().st_size if self.audit.exists() else 0

    def _pick(self) -> tuple[str, str]:
        ids = sorted(self.ledger.known)
        choices = ["create"] if len(ids) < MAX_SESSIONS else ["delete"]
        if ids:
            choices += ["append", "append", "stream", "compact"]
        kind = self.rng.choice(choices)
        if kind == "create":
            self.ledger.serial += 1
            return kind, f"{self.ledger.name}-{self.ledger.serial}"
        return kind, self.rng.choice(ids)

    def step(self) -> None:
        kind, sid = self._pick()
        known = self.ledger.known
        self.ledger.flight = InFlight(sid, "append" if kind == "stream" else kind)
        sent = self._offset()
        if kind == "create":
            text = "".join(self.rng.choice("abcdefgh ") for _ in range(self.rng.randint(120, 400)))
            body = {"model": "tiny", "id": sid, "prompt": text}
            auto = self.rng.random() < 0.3
            if auto:
                body["auto_compact"] = AUTO
            r = self.http.post("/v1/sessions", json=body)
            assert r.status_code == 201, r.text
            state = Known(r.json()["tokens"], len(r.json()["compactions"]), auto)
        elif kind == "delete":
            r = self.http.delete(f"/v1/sessions/{sid}")
            assert r.status_code == 200, r.text
            state = None
        elif kind == "compact":
            body = {"ratio": 2, "method": "am-highest", "keep_recent": 8}
            if self.rng.random() < 0.5:
                body["quantize"] = "int8"
            r = self.http.post(f"/v1/sessions/{sid}/compact", json=body)
            if r.status_code == 400 and ("leaves nothing" in r.text or "target" in r.text):
                # Too small to compact (keep_recent leaves no region, or no smaller target):
                # refused, no change.
                self.ledger.flight = None
                return
            assert r.status_code == 200, r.text
            info = r.json()["session"]
            old = known[sid]
            state = Known(info["tokens"], len(info["compactions"]), old.auto, old.pending)
        else:
            grown = self._append(sid, stream=kind == "stream")
            old = known[sid]
            state = Known(old.tokens + grown - old.pending, old.compactions, old.auto, True)
        self.acks.append(Ack(self.ledger.flight.kind, sid, sent, self._offset()))
        self.ledger.flight = None
        if state is None:
            del known[sid]
            return
        known[sid] = state
        # What the acknowledgement committed, read from disk. A session with a policy may
        # have compacted itself since: then that state is the one to expect.
        meta, digest = _committed(self.store / sid) or ({}, None)
        assert meta, f"{sid} acknowledged but not on disk"
        assert _tokens(meta) == state.tokens, (sid, _tokens(meta), state)
        if len(meta["compactions"]) != state.compactions:
            assert state.auto and len(meta["compactions"]) > state.compactions, (sid, meta)
            state.compactions = len(meta["compactions"])
        state.digest = digest
        # The server answers from it. Not kept as the reference: this peek may share a batch
        # with the other clients' rows, and the tiny model's near-tied logits can flip its
        # greedy token with the batch's rounding; `_check` peeks one session at a time.
        _peek(self.http, sid)

    def _append(self, sid: str, stream: bool) -> int:
        """Continue the session with APPEND; the tokens the acknowledged answer added."""
        body = {"model": "tiny", "session_id": sid, **APPEND}
        if not stream:
            r = self.http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return usage["prompt_tokens"] + usage["completion_tokens"]
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        usage, done = None, False
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                assert not done, "data after [DONE]"
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
        assert done and usage is not None, "a stream without [DONE] or usage"
        return usage["prompt_tokens"] + usage["completion_tokens"]


def _peek(http: httpx.Client, sid: str) -> str:
    r = http.post("/v1/completions", json={"model": "tiny", "session_id": sid, **PEEK})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ---- after a restart ---------------------------------------------------------------------------
def _explained(k: Known, state: tuple[int, int], flight: InFlight | None, sid: str) -> bool:
    """Whether a session found in `state` (tokens, compactions) other than its acknowledged
    one was changed by its client's request in flight, or by its own online compaction."""
    tokens, compactions = state
    moved = flight is not None and flight.sid == sid
    auto = k.auto and compactions > k.compactions  # its policy compacted it meanwhile
    if moved and flight.kind == "append" and tokens > k.tokens:
        return compactions == k.compactions or auto
    if moved and flight.kind == "compact" and tokens == k.tokens:
        return compactions == k.compactions + 1 or auto
    return auto and tokens == k.tokens


def _check(base: str, store: Path, ledgers: list[Ledger]) -> int:
    """Every acknowledged session is on disk as acknowledged (its digest; or as the request in
    flight, or its own policy, left it), and the server answers from it as before; returns how
    many were lost (the test fails on any)."""
    listed = {s["id"]: s for s in httpx.get(f"{base}/v1/sessions").json()["data"]}
    http = httpx.Client(base_url=base, timeout=120)
    lost = 0
    for ledger in ledgers:
        known, flight = ledger.known, ledger.flight
        if flight is not None and flight.kind == "create" and flight.sid in listed:
            info = listed[flight.sid]  # done, not yet answered
            known[flight.sid] = Known(
                info["tokens"], len(info["compactions"]), bool(info["auto_compact"])
            )
        for sid, k in list(known.items()):
            if sid not in listed:
                if flight is not None and flight.sid == sid and flight.kind == "delete":
                    del known[sid]
                else:
                    lost += 1
                continue
            meta, digest = _committed(store / sid) or ({}, None)
            assert meta, f"{sid} listed but has no committed version on disk"
            info = listed[sid]
            state = (info["tokens"], len(info["compactions"]))
            assert state == (_tokens(meta), len(meta["compactions"])), (sid, info, meta)
            if state == (k.tokens, k.compactions):
                if k.digest is not None:  # None: the kill came before the client read it
                    assert digest == k.digest, f"{sid}'s stored tokens or KV changed"
                k.digest = digest
                answer = _peek(http, sid)
                assert k.answer in (None, answer), f"{sid} answers differently after the restart"
                k.answer = answer
                continue
            assert _explained(k, state, flight, sid), f"{sid} changed unasked: {state} vs {k}"
            pending = meta["next_input"] is not None
            answer = _peek(http, sid)
            known[sid] = Known(*state, k.auto, pending, digest, answer)
        ledger.flight = None
    named = {sid for ledger in ledgers for sid in ledger.known}
    assert set(listed) <= named, f"sessions nobody acknowledged: {set(listed) - named}"
    return lost


def _kill_when(
    proc: subprocess.Popen, store: Path, mode: str, rng: random.Random, clients: list[Client]
) -> None:
    if mode == "random":
        time.sleep(rng.uniform(0.5, 4.0))
    else:  # the moment a write is in progress (or after 4 s, whatever comes first)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            if _write_in_progress(store):
                break
            time.sleep(0.0005)
    for client in clients:
        client.killed.set()
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_at_any_moment_loses_no_acknowledged_session(model_dir, audit_hook, tmp_path):
    store, log = (tmp_path / "sessions").resolve(), tmp_path / "server.log"
    store.mkdir()
    rng = random.Random(1234)
    ledgers = [Ledger(f"c{i}") for i in range(CLIENTS)]
    rounds = kills_in_write = lost = acks = 0
    started = time.monotonic()
    while rounds < ROUNDS and time.monotonic() - started < DEADLINE_S:
        audit = tmp_path / f"audit-{rounds}.log"
        proc, base = _start(model_dir, store, log, audit_hook, audit)
        try:
            lost += _check(base, store, ledgers)
            clients = [
                Client(base, ledger, random.Random(rng.random()), store, audit)
                for ledger in ledgers
            ]
            for client in clients:
                client.start()
            _kill_when(proc, store, "random" if rounds % 2 else "in-write", rng, clients)
            for client in clients:
                client.join(120)
                assert not client.is_alive(), f"{client.ledger.name} hung after the kill"
                assert client.error is None, f"{client.ledger.name}: {client.error}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines, ends = _audit_lines(audit)
        for client in clients:
            for ack in client.acks:
                why = _durable_before(ack, store, lines, ends)
                assert why is None, f"round {rounds}, {ack.kind} of {ack.sid}: {why}"
            acks += len(client.acks)
        kills_in_write += _interrupted_writes(store) > 0
        rounds += 1
    proc, base = _start(model_dir, store, log, audit_hook, tmp_path / "audit-last.log")
    try:
        lost += _check(base, store, ledgers)  # the last kill is checked too
        assert not _interrupted_writes(store), "start-up left an interrupted write behind"
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    sessions = sum(len(ledger.known) for ledger in ledgers)
    print(
        f"\ncrash loop: {rounds} rounds in {time.monotonic() - started:.0f} s, {acks} "
        f"acknowledged changes audited, {kills_in_write} kills during a write, {lost} sessions "
        f"lost, {sessions} sessions at the end"
    )
    assert rounds >= ROUNDS, f"only {rounds} rounds in {DEADLINE_S} s"
    assert lost == 0
    assert "not loading" not in text, text[-2000:]  # no session was found corrupt
    assert kills_in_write >= ROUNDS // 4, "too few kills landed inside a write to prove much"
    assert acks >= ROUNDS, f"only {acks} acknowledged changes in {rounds} rounds"
    assert os.listdir(store)  # sessions were really made
