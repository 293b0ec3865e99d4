"""A request whose write fails changes nothing: not the session in memory, not its files, not the
shared tier. Real servers (tiny model), real OS errors: the server process's file size limit
(RLIMIT_FSIZE) is lowered to 0 from outside while it runs, with SIGXFSZ ignored, so every write
of a file fails as on a full disk (EFBIG where a full disk says ENOSPC: the same path through
the server); the Redis tier refuses its writes midway through an ACL."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import server_process, tree_snapshot
from test_replicas import running_redis

CONTEXT = "The code name of the blue box is Orchid-417. " * 3
TINY = ("--device", "cpu", "--dtype", "float32")
UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)


@contextmanager
def _started(args: tuple[str, ...]) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server whose writes may be made to fail: started with SIGXFSZ ignored (a disposition
    the child inherits), so a write past its file size limit fails with EFBIG instead of
    killing it."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with server_process(args) as (base, proc):
            signal.signal(signal.SIGXFSZ, previous)
            yield base, proc
    finally:
        signal.signal(signal.SIGXFSZ, previous)


@contextmanager
def disk_full(proc: subprocess.Popen) -> Iterator[None]:
    """Every file write of the server fails (its RLIMIT_FSIZE is 0) until the block ends."""
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
    try:
        yield
    finally:
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, UNLIMITED)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("full-disk-sessions")


@pytest.fixture(scope="module")
def server(tiny_llama_4k_dir, store) -> Iterator[tuple[str, subprocess.Popen]]:
    # A 4K context: the function-call round trip's prompt shows a tool (~600 byte tokens).
    args = ("--model", f"tiny={tiny_llama_4k_dir}", *TINY, "--sessions-dir", str(store))
    with _started(args) as started:
        yield started


def _post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120, **kw)


def _complete(base: str, **body) -> httpx.Response:
    return _post(
        base, "/v1/completions", {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
    )


def _ask(base: str, sid: str) -> str:
    """A question that leaves the session as it is (append: false)."""
    r = _complete(base, prompt="Q:", session_id=sid, append=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _state(base: str, sid: str) -> dict:
    """What the API says of a session, less what moves between memory and disk."""
    info = httpx.get(f"{base}/v1/sessions/{sid}").json()
    kept = ("tokens", "logical_length", "physical_tokens", "disk_bytes", "compactions")
    return {k: info[k] for k in kept}


def _full(r: httpx.Response) -> None:
    assert r.status_code == 507, r.text
    error = r.json()["error"]
    assert error["code"] == "session_store_full" and "out of space" in error["message"]


def _failures(base: str, where: str) -> float:
    metrics = httpx.get(f"{base}/metrics").text
    line = f'cdlm_serve:session_store_write_failures_total{{where="{where}"}} '
    (value,) = [x.removeprefix(line) for x in metrics.splitlines() if x.startswith(line)]
    return float(value)


def _make(base: str, sid: str) -> dict:
    r = _post(base, "/v1/sessions", {"model": "tiny", "id": sid, "prompt": CONTEXT})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_create_on_a_full_disk_is_507_and_leaves_nothing(server, store):
    base, proc = server
    before = tree_snapshot(store)
    failures = _failures(base, "disk")
    with disk_full(proc):
        _full(_post(base, "/v1/sessions", {"model": "tiny", "id": "new", "prompt": CONTEXT}))
        _full(_post(base, "/v1/sessions", {"model": "tiny", "id": "empty"}))  # meta.json only
        assert httpx.get(f"{base}/v1/sessions/new").status_code == 404
    assert tree_snapshot(store) == before
    assert "new" not in [s["id"] for s in httpx.get(f"{base}/v1/sessions").json()["data"]]
    assert _failures(base, "disk") == failures + 2
    _make(base, "new")  # the id was never taken


def test_an_append_that_cannot_be_stored_changes_nothing(server, store):
    base, proc = server
    _make(base, "grow")
    answer, state, files = _ask(base, "grow"), _state(base, "grow"), tree_snapshot(store / "grow")
    with disk_full(proc):
        _full(_complete(base, prompt="More text.", session_id="grow"))
        assert _state(base, "grow") == state
        # Still readable while the disk is full: a question, and the same answer as before.
        assert _ask(base, "grow") == answer
        # A streamed append: an error event before [DONE], and nothing kept.
        body = {"model": "tiny", "prompt": "More.", "max_tokens": 4, "temperature": 0}
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json={**body, "session_id": "grow", "stream": True},
            timeout=120,
        ) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == (
            "session_store_full"
        )
        assert _state(base, "grow") == state
        assert _ask(base, "grow") == answer
    assert tree_snapshot(store / "grow") == files
    # Once there is room again, a retry is appended once (not with the failed ones before it).
    r = _complete(base, prompt="More text.", session_id="grow")
    assert r.status_code == 200, r.text
    grown = state["tokens"] + len("More text.") + r.json()["usage"]["completion_tokens"]
    assert _state(base, "grow")["tokens"] == grown


@pytest.mark.parametrize(
    ("sid", "spec"),
    [
        ("squeeze", {"ratio": 2, "method": "am-highest", "query_source": "repeat"}),
        # Non-uniform: each head its own count, the segment written ragged.
        ("squeeze-global", {"ratio": 2, "method": "kvzip", "budgets": "global"}),
    ],
)
def test_a_compaction_that_cannot_be_stored_changes_nothing(server, store, sid, spec):
    base, proc = server
    _make(base, sid)
    answer, state = _ask(base, sid), _state(base, sid)
    files = tree_snapshot(store / sid)
    with disk_full(proc):
        _full(_post(base, f"/v1/sessions/{sid}/compact", spec))
        assert _state(base, sid) == state
        assert _ask(base, sid) == answer  # the whole cache, not the compacted one
    assert tree_snapshot(store / sid) == files
    r = _post(base, f"/v1/sessions/{sid}/compact", spec)
    assert r.status_code == 200, r.text
    assert _state(base, sid)["physical_tokens"] == r.json()["tokens_after"] < len(CONTEXT)


def test_a_response_that_cannot_be_stored_is_not_stored(server, store):
    base, proc = server
    body = {"model": "tiny", "input": "Hello there", "max_output_tokens": 4, "temperature": 0}
    before = tree_snapshot(store)
    with disk_full(proc):
        _full(_post(base, "/v1/responses", body))
        kinds = _streamed_kinds(base, body)
        assert kinds[-1] == "error" and "response.completed" not in kinds
    assert tree_snapshot(store) == before
    first = _post(base, "/v1/responses", body)
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    stored, files = httpx.get(f"{base}/v1/responses/{rid}").json(), tree_snapshot(store)
    listed = _listed(base)
    follow = {**body, "input": "And then?", "previous_response_id": rid}
    with disk_full(proc):
        _full(_post(base, "/v1/responses", follow))
        # The previous response can still be continued without storing (store: false).
        r = _post(base, "/v1/responses", {**follow, "store": False})
        assert r.status_code == 200, r.text
    assert tree_snapshot(store) == files and _listed(base) == listed
    assert httpx.get(f"{base}/v1/responses/{rid}").json() == stored
    r = _post(base, "/v1/responses", follow)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{base}/v1/responses/{r.json()['id']}").status_code == 200


def test_a_function_call_round_trip_that_cannot_be_stored_is_not_stored(server, store):
    """A forced call's response and the call's result sent back: on a full disk neither is
    stored, streamed or not, and the stored call goes on as before once there is room."""
    time_tool = {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
        },
    }
    body = {
        "model": "tiny",
        "input": "Time?",
        "tools": [time_tool],
        "max_output_tokens": 160,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    (base, proc), before, listed = server, tree_snapshot(store), _listed(server[0])
    with disk_full(proc):
        _full(_post(base, "/v1/responses", body))
        kinds = _streamed_kinds(base, body)
        assert "error" in kinds and "response.completed" not in kinds
        assert "response.output_item.added" in kinds  # the call was streamed, not stored
    assert tree_snapshot(store) == before and _listed(base) == listed  # not even in memory
    first = _post(base, "/v1/responses", body)
    assert first.status_code == 200, first.text
    (call,) = first.json()["output"]
    assert call["type"] == "function_call"
    rid = first.json()["id"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "14:00"}
    follow = {**body, "input": [result], "previous_response_id": rid, "tool_choice": "none",
              "max_output_tokens": 8}  # fmt: skip
    unstored = _post(base, "/v1/responses", {**follow, "store": False}).json()
    stored, files = httpx.get(f"{base}/v1/responses/{rid}").json(), tree_snapshot(store)
    listed = _listed(base)
    with disk_full(proc):
        _full(_post(base, "/v1/responses", follow))
        # Still continued without storing, from the stored call, to the same answer.
        again = _post(base, "/v1/responses", {**follow, "store": False}).json()
        assert _contents(again) == _contents(unstored)
    assert tree_snapshot(store) == files and _listed(base) == listed
    assert httpx.get(f"{base}/v1/responses/{rid}").json() == stored
    r = _post(base, "/v1/responses", follow)
    assert r.status_code == 200, r.text
    assert _contents(r.json()) == _contents(unstored)


def _streamed_kinds(base: str, body: dict) -> list[str]:
    """The event types of a streamed Responses request, in order (errors included)."""
    with httpx.stream(
        "POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=120
    ) as stream:
        kinds = [line.removeprefix("event: ") for line in stream.iter_lines()]
    return [kind for kind in kinds if kind.startswith("response.") or kind == "error"]


def _listed(base: str) -> list[str]:
    """The sessions the server holds (responses' among them), on disk or only in memory."""
    r = httpx.get(f"{base}/v1/sessions")
    return sorted(s["id"] for s in r.json()["data"])


def _contents(response: dict) -> list:
    return [item["content"] for item in response["output"]]


def test_what_a_failed_append_left_is_not_on_disk_after_a_kill(tiny_llama_dir, tmp_path):
    """SIGKILL after failed writes: a new process over the same folder has the session as it
    was answered, not with the appends and compaction that failed."""
    args = ("--model", f"tiny={tiny_llama_dir}", *TINY, "--sessions-dir", str(tmp_path))
    with _started(args) as (base, proc):
        _make(base, "kept")
        answer, state = _ask(base, "kept"), _state(base, "kept")
        with disk_full(proc):
            _full(_complete(base, prompt="Lost text " * 20, session_id="kept"))
            _full(_post(base, "/v1/sessions/kept/compact", {"ratio": 2}))
        assert _ask(base, "kept") == answer  # with room again: a request that writes nothing
        proc.kill()
        proc.wait()
    with _started(args) as (base, _):
        assert _state(base, "kept") == state
        assert _ask(base, "kept") == answer


def test_a_stream_cut_before_its_end_keeps_nothing_and_after_its_last_token_keeps_all(server):
    """docs/api.md: an append is kept when the answer finished (its last token generated),
    whether or not the client read [DONE]; a stream cut before that keeps nothing."""
    base, _ = server
    _make(base, "cut")
    state = _state(base, "cut")
    body = {"model": "tiny", "prompt": "Go:", "temperature": 0, "ignore_eos": True}
    url = f"{base}/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "max_tokens": 300, "session_id": "cut", "stream": True}
    ) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the first token, then the client goes
    _ask(base, "cut")  # takes the session's lock: the cut request has let it go
    assert _state(base, "cut") == state
    with httpx.stream(
        "POST", url, json={**body, "max_tokens": 5, "session_id": "cut", "stream": True}
    ) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"][0]["finish_reason"] is not None:
                break  # gone before [DONE]
    _ask(base, "cut")
    assert _state(base, "cut")["tokens"] == state["tokens"] + len("Go:") + 5


# ---- the shared tier -----------------------------------------------------------------------------
@contextmanager
def tier_refusing_bytes(url: str, sid: str) -> Iterator[None]:
    """Redis refuses, through its ACL, every key but the session's own and the blobs'
    reference sets: a publish gets its lease and adds its references, then fails on the
    segment bytes (midway, after writes that succeeded)."""
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"~cdlm:session:{sid}:*", "~cdlm:session:blob:*:refs"]
    client.acl_setuser(
        "default", enabled=True, nopass=True, commands=["+@all"], reset_keys=True, keys=keys
    )
    try:
        yield
    finally:
        client.acl_setuser("default", enabled=True, nopass=True, commands=["+@all"], keys=["~*"])


def test_a_tier_write_that_fails_midway_changes_nothing_on_any_replica(tiny_llama_dir, tmp_path):
    import redis

    with running_redis(tmp_path) as redis_url:
        shared = (*TINY, "--sessions-redis", redis_url, "--model", f"tiny={tiny_llama_dir}")
        with (
            server_process((*shared, "--sessions-dir", str(tmp_path / "a"))) as (a, _),
            server_process((*shared, "--sessions-dir", str(tmp_path / "b"))) as (b, _),
        ):
            _make(a, "tier")
            answer, state = _ask(b, "tier"), _state(b, "tier")  # b fetched the shared copy
            client = redis.Redis.from_url(redis_url)
            tier = {k: client.get(k) for k in client.keys("cdlm:session:tier:*")}
            files = tree_snapshot(tmp_path / "a")
            failures = _failures(a, "tier")
            with tier_refusing_bytes(redis_url, "tier"):
                r = _complete(a, prompt="More text " * 10, session_id="tier")
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "session_tier_unavailable"
            assert _failures(a, "tier") == failures + 1
            assert {k: client.get(k) for k in client.keys("cdlm:session:tier:*")} == tier
            assert tree_snapshot(tmp_path / "a") == files
            for replica in (a, b):
                assert _state(replica, "tier") == state
                assert _ask(replica, "tier") == answer
            r = _complete(a, prompt="More text " * 10, session_id="tier")
            assert r.status_code == 200, r.text
            assert _state(b, "tier")["tokens"] > state["tokens"]  # b sees the new version
