"""Sessions across replicas, with the real parts: redis-server, two cdlm-serve replicas sharing
it (--sessions-redis), and nginx in front with deploy/nginx's config (sessions hashed by
X-Session-Id). A replica that dies takes nothing with it; two replicas never change one session
at once."""

from __future__ import annotations

import concurrent.futures
import hashlib
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import free_port, server_process
from test_ops import _tool

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CONTEXT = " ".join(
    f"Fact {i}: the {color} box holds {i * 7} marbles."
    for i, color in enumerate(["red", "blue", "green", "amber", "violet", "white", "grey"])
)  # ~320 byte tokens: the tiny model's context is 512


def _wait_for(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("not ready")
        time.sleep(0.1)


@contextmanager
def running_redis(folder: Path, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    proc = subprocess.Popen(
        [_tool("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        cwd=folder,
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        _wait_for(up)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def running_nginx(folder: Path, replicas: list[str]) -> Iterator[str]:
    """deploy/nginx/nginx.conf in front of `replicas` (host:port), on a free port."""
    port = free_port()
    servers = "".join(f"    server {r} max_fails=1 fail_timeout=10s;\n" for r in replicas)
    upstreams = (DEPLOY / "nginx" / "cdlm-upstreams.conf").read_text()
    # The replicas of this test instead of the compose service names.
    kept = [line for line in upstreams.splitlines() if "cdlm-serve-" not in line]
    text = "\n".join(kept).replace("{\n", "{\n" + servers)
    (folder / "cdlm-upstreams.conf").write_text(text)
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    assert "listen 8080;" in conf
    (folder / "nginx.conf").write_text(conf.replace("listen 8080;", f"listen 127.0.0.1:{port};"))
    (folder / "tmp").mkdir()
    proc = subprocess.Popen(
        [
            _tool("nginx"),
            "-p",
            str(folder),
            "-c",
            str(folder / "nginx.conf"),
            "-g",
            f"daemon off; pid {folder / 'nginx.pid'}; error_log {folder / 'error.log'};",
        ]
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_for(up)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def cluster(tmp_path, tiny_llama_dir):
    """redis, two replicas sharing it (each its own session folder), nginx in front."""
    with running_redis(tmp_path) as redis_url:
        args = ("--model", f"tiny={tiny_llama_dir}", "--device", "cpu", "--dtype", "float32")
        shared = ("--sessions-redis", redis_url)
        with (
            server_process((*args, *shared, "--sessions-dir", str(tmp_path / "a"))) as a,
            server_process((*args, *shared, "--sessions-dir", str(tmp_path / "b"))) as b,
        ):
            replicas = [a[0].removeprefix("http://"), b[0].removeprefix("http://")]
            nginx_dir = tmp_path / "nginx"
            nginx_dir.mkdir()
            with running_nginx(nginx_dir, replicas) as front:
                yield (
                    front,
                    {a[0]: (a[1], tmp_path / "a"), b[0]: (b[1], tmp_path / "b")},
                    redis_url,
                )


def _peek(url: str, sid: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": " Which box", "max_tokens": 12, "temperature": 0}
    body["append"] = False
    return httpx.post(
        f"{url}/v1/completions", json=body, headers={"X-Session-Id": sid}, timeout=120
    )


def test_a_session_outlives_the_replica_that_held_it(cluster):
    front, replicas, _ = cluster
    sid = "doc-1"
    created = httpx.post(
        f"{front}/v1/sessions",
        json={"model": "tiny", "id": sid, "prompt": CONTEXT},
        headers={"X-Session-Id": sid},
        timeout=120,
    )
    assert created.status_code == 201, created.text
    before = created.json()["tokens"]
    compacted = httpx.post(
        f"{front}/v1/sessions/{sid}/compact",
        json={"ratio": 10, "method": "am-highest"},
        headers={"X-Session-Id": sid},
        timeout=300,
    )
    assert compacted.status_code == 200, compacted.text
    first = _peek(front, sid)
    assert first.status_code == 200, first.text
    # The replica that holds it (nginx hashed the id to it) has its files; kill it outright.
    holders = [url for url, (_, folder) in replicas.items() if (folder / sid).is_dir()]
    assert len(holders) == 1, holders
    proc, _ = replicas[holders[0]]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    again = _peek(front, sid)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    survivor = next(url for url in replicas if url != holders[0])
    info = httpx.get(f"{survivor}/v1/sessions/{sid}").json()
    assert info["tokens"] == before and info["compactions"]  # the compacted version
    assert (replicas[survivor][1] / sid).is_dir()  # fetched from Redis into its own store


def test_two_replicas_never_change_one_session_at_once(cluster):
    _, replicas, _ = cluster
    sid = "shared-1"
    a, b = list(replicas)
    body = {"model": "tiny", "prompt": " More:", "max_tokens": 40, "temperature": 0}
    body["ignore_eos"] = True

    def create(url: str, name: str) -> int:
        r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": name, "prompt": CONTEXT})
        assert r.status_code == 201, r.text
        return r.json()["tokens"]

    def compact(url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/sessions/{sid}/compact", json={"ratio": 4}, timeout=300)

    def extend(url: str, name: str = sid) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json={**body, "session_id": name}, timeout=300)

    # How much one extension grows a session, measured alone on another session.
    alone = create(a, "probe")
    assert extend(b, "probe").status_code == 200
    growth = httpx.get(f"{a}/v1/sessions/probe").json()["tokens"] - alone
    assert growth > 40
    tokens = create(a, sid)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(compact, a), pool.submit(extend, b), pool.submit(extend, a)]
        codes = [job.result().status_code for job in jobs]
    assert set(codes) <= {200, 409}, codes
    assert 200 in codes
    grown = growth * sum(
        1 for code, kind in zip(codes, "cee", strict=True) if kind == "e" and code == 200
    )
    # Both replicas see the same, whole session: every change that was acknowledged, once.
    views = [httpx.get(f"{url}/v1/sessions/{sid}").json() for url in (a, b)]
    assert views[0]["tokens"] == views[1]["tokens"] == tokens + grown
    assert len(views[0]["compactions"]) == len(views[1]["compactions"]) == (codes[0] == 200)
    for url in (a, b):  # and either can go on with it
        assert _peek(url, sid).status_code == 200


def test_a_session_tier_that_is_down_answers_503_and_loses_nothing(tmp_path, tiny_llama_dir):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    args = ("--model", f"tiny={tiny_llama_dir}", "--device", "cpu", "--sessions-redis", dead)
    with server_process((*args, "--sessions-dir", str(tmp_path))) as (url, _):
        r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "x", "prompt": "hi"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "session_tier_unavailable"
        assert httpx.get(f"{url}/v1/sessions/x").status_code == 503
        assert httpx.get(f"{url}/health").status_code == 200  # the rest of the server works
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
    assert not any(p for p in tmp_path.iterdir() if not p.name.startswith("."))


def test_redis_going_away_and_coming_back_empty_loses_no_session(tmp_path, tiny_llama_dir):
    """The tier is a copy of what replicas stored: while it is down, changes answer 503 and
    nothing stored is lost; when it comes back empty, the sessions are written to it again."""
    port = free_port()
    tier = ("--sessions-redis", f"redis://127.0.0.1:{port}/0", "--session-lock-wait", "2")
    args = ("--model", f"tiny={tiny_llama_dir}", "--device", "cpu", "--dtype", "float32", *tier)
    body = {"model": "tiny", "prompt": " More:", "max_tokens": 8, "temperature": 0}
    body |= {"session_id": "k", "ignore_eos": True}
    with (
        server_process((*args, "--sessions-dir", str(tmp_path / "a"))) as (a, _),
        server_process((*args, "--sessions-dir", str(tmp_path / "b"))) as (b, _),
    ):
        with running_redis(tmp_path, port):
            r = httpx.post(f"{a}/v1/sessions", json={"model": "tiny", "id": "k", "prompt": CONTEXT})
            assert r.status_code == 201
            grown = httpx.post(f"{a}/v1/completions", json=body, timeout=120)
            assert grown.status_code == 200
            stored = httpx.get(f"{a}/v1/sessions/k").json()["tokens"]
        # Redis is gone (and its data with it).
        down = httpx.post(f"{a}/v1/completions", json=body, timeout=120)
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"] == "session_tier_unavailable"
        assert httpx.delete(f"{a}/v1/sessions/k").status_code == 503  # nothing deleted
        with running_redis(tmp_path, port):  # back, empty
            # Replica b never had it, and the tier does not have it yet: not found...
            assert httpx.get(f"{b}/v1/sessions/k").status_code == 404
            # ...until a uses it: a's stored copy is written to the tier again, whole.
            again = httpx.post(f"{a}/v1/completions", json=body, timeout=120)
            assert again.status_code == 200, again.text
            view = httpx.get(f"{b}/v1/sessions/k").json()
            assert view["tokens"] == httpx.get(f"{a}/v1/sessions/k").json()["tokens"]
            assert view["tokens"] > stored


def _blob_parts(client) -> list[bytes]:
    """The keys holding segment bytes in the tier (not their reference sets)."""
    return [k for k in client.keys("cdlm:session:blob:*") if not k.endswith(b":refs")]


def _tier_bytes(client) -> int:
    return sum(client.strlen(k) for k in _blob_parts(client))


def _filled_cache(slots: int):
    import torch

    from cdlm_serve.models.kv_cache import KVCache

    cache = KVCache.allocate(2, 1, 2, 8, slots, "cpu", torch.float32)
    for layer in range(2):
        cache.keys[layer][0] = torch.randn(2, slots, 8)
        cache.values[layer][0] = torch.randn(2, slots, 8)
    return cache


def _turn(root: Path, sid: str, cache, slots: int, parent=None):
    """A session of `slots` slots. With `parent`, only the slots past it are written: another
    session is forked from it as a response is (its segments hard-linked), the same one
    appended to."""
    from cdlm_serve.engine.sessions import files as session_files
    from cdlm_serve.engine.sessions.files import Version

    cache.lengths[0] = cache.logical[0] = slots
    draft = Version(sid, "m", list(range(slots)), None, [], 0.0, 0, 0, 0, [])
    if parent is None:
        return session_files.write_version(root / sid, draft, cache, 0)
    draft.segments = list(parent.segments)
    fork = parent.id != sid
    draft.generation = 0 if fork else parent.generation
    return session_files.write_version(
        root / sid, draft, cache, parent.length, link_from=root / parent.id if fork else None
    )


def test_a_conversation_holds_each_segment_once_in_the_tier(tmp_path, monkeypatch):
    """A response is forked from the one before and hard-links its segments: the tier keeps a
    segment once by its content, not once per session naming it (a conversation of N turns held
    N^2/2 turns' worth). A blob goes with the last version naming it; a refused publish takes
    back only its own references."""
    import redis

    from cdlm_serve.engine.sessions.mirror import MirrorError, SessionConflict, SessionMirror

    cache = _filled_cache(256)
    root = tmp_path / "a"
    for folder in "abc":
        (tmp_path / folder).mkdir()
    with running_redis(tmp_path) as url:
        mirror, client = SessionMirror(url), redis.Redis.from_url(url)
        turns = []
        for n in range(6):
            turns.append(_turn(root, f"r{n}", cache, 40 * (n + 1), turns[-1] if turns else None))
            assert mirror.acquire(f"r{n}", 1)
            mirror.publish(f"r{n}", root / f"r{n}", turns[-1], parent=None)
        files = {seg.file: seg.bytes for v in turns for seg in v.segments}
        assert len(files) == 6 and len(turns[-1].segments) == 6  # each turn wrote one
        once = sum(files.values())
        assert _tier_bytes(client) == once  # not sum(v.disk_bytes for v in turns): ~3.5x
        for version in turns[:-1]:  # the earlier responses deleted: the last one is whole
            mirror.remove(version.id)
        assert _tier_bytes(client) == once
        reader = SessionMirror(url)
        assert reader.fetch("r5", tmp_path / "b" / "r5") == turns[-1]
        # The fetched files were checked against their digests: their next publish reuses them.
        with monkeypatch.context() as m:
            m.setattr(hashlib, "file_digest", None)  # hashing again would fail
            for seg in turns[-1].segments:
                digest = hashlib.sha256((root / "r5" / seg.file).read_bytes()).hexdigest()
                assert reader._digest(tmp_path / "b" / "r5" / seg.file) == digest
        reader.close()

        last = turns[-1]
        grown = _turn(root, "r5", cache, 250, last)  # an append: one new segment
        with pytest.raises(SessionConflict):  # not made from the shared copy
            mirror.publish("r5", root / "r5", grown, parent=None)
        assert _tier_bytes(client) == once  # its new segment's upload taken back, nothing else
        mirror.publish("r5", root / "r5", grown, parent=last)
        assert _tier_bytes(client) == once + grown.segments[-1].bytes
        rewritten = _turn(root, "r5", cache, 250)  # every slot in one new file (a compaction)
        mirror.publish("r5", root / "r5", rewritten, parent=grown)
        assert _tier_bytes(client) == rewritten.disk_bytes  # the replaced ones' blobs dropped
        assert SessionMirror(url).fetch("r5", tmp_path / "c" / "r5") == rewritten
        (part,) = _blob_parts(client)
        client.setrange(part, 1000, b"\xff\xfe")  # bytes damaged in the tier: never installed
        with pytest.raises(MirrorError, match="damaged"):
            SessionMirror(url).fetch("r5", tmp_path / "c" / "r5")
        mirror.remove("r5")
        assert client.keys("cdlm:session:blob:*") == []
        mirror.close()


def test_a_session_published_before_blobs_were_shared_is_still_read(tmp_path):
    """The tier's earlier layout (each session's segments under its own keys, no `blobs`) is
    fetched as it is, and replaced by the shared layout at the session's next publish; a
    replica not upgraded yet that publishes over a shared-layout version (leaving its `blobs`
    record behind) is read in its layout too."""
    import json

    import redis

    from cdlm_serve.engine.sessions.mirror import SessionMirror

    cache = _filled_cache(64)
    for folder in "abc":
        (tmp_path / folder).mkdir()
    old = _turn(tmp_path / "a", "s", cache, 50)

    def publish_as_before(client, version) -> None:  # what the earlier SessionMirror wrote
        for seg in version.segments:
            data = (tmp_path / "a" / "s" / seg.file).read_bytes()
            client.set(f"cdlm:session:s:seg:{seg.file}:0", data)
        client.set("cdlm:session:s:meta", json.dumps(version.to_json()))
        client.set("cdlm:session:s:gen", f"{version.generation}:{version.commit}")

    with running_redis(tmp_path) as url:
        client = redis.Redis.from_url(url)
        publish_as_before(client, old)
        mirror = SessionMirror(url)
        assert mirror.fetch("s", tmp_path / "b" / "s") == old
        assert mirror.acquire("s", 1)
        new = _turn(tmp_path / "a", "s", cache, 60, old)
        mirror.publish("s", tmp_path / "a" / "s", new, parent=old)
        assert client.keys("cdlm:session:s:seg:*") == []
        assert _tier_bytes(client) == new.disk_bytes
        assert mirror.fetch("s", tmp_path / "c" / "s") == new
        older = _turn(tmp_path / "a", "s", cache, 64, new)  # by a replica not upgraded yet
        publish_as_before(client, older)
        assert client.exists("cdlm:session:s:blobs")  # the shared layout's record, stale
        assert SessionMirror(url).fetch("s", tmp_path / "b" / "s") == older
        mirror.close()


def test_segments_larger_than_a_redis_value_travel_in_parts(tmp_path):
    """Redis holds at most 512 MB in one value; a segment goes in parts of `chunk_bytes` and
    comes back whole (here with parts of 1,000 bytes), and a delete drops every part."""
    import redis
    import torch

    from cdlm_serve.engine.sessions import files as session_files
    from cdlm_serve.engine.sessions.files import Version
    from cdlm_serve.engine.sessions.mirror import SessionMirror
    from cdlm_serve.models.kv_cache import KVCache

    cache = KVCache.allocate(2, 1, 2, 8, 64, "cpu", torch.float32)
    for layer in range(2):
        cache.keys[layer][0, :, :50] = torch.randn(2, 50, 8)
        cache.values[layer][0, :, :50] = torch.randn(2, 50, 8)
    cache.lengths[0] = cache.logical[0] = 50
    draft = Version("s", "m", list(range(50)), None, [], 0.0, 0, 0, 0, [])
    (tmp_path / "a").mkdir()
    version = session_files.write_version(tmp_path / "a" / "s", draft, cache, 0)
    assert version.segments[0].bytes > 5_000
    with running_redis(tmp_path) as url:
        mirror = SessionMirror(url, chunk_bytes=1000)
        assert mirror.acquire("s", 1)
        mirror.publish("s", tmp_path / "a" / "s", version, parent=None)
        client = redis.Redis.from_url(url)
        parts = _blob_parts(client)
        assert len(parts) == -(-version.segments[0].bytes // 1000)
        assert max(len(client.get(k)) for k in parts) == 1000
        (tmp_path / "b").mkdir()
        fetched = SessionMirror(url, chunk_bytes=1000).fetch("s", tmp_path / "b" / "s")
        assert fetched == version
        seg = version.segments[0].file
        assert (tmp_path / "b" / "s" / seg).read_bytes() == (
            tmp_path / "a" / "s" / seg
        ).read_bytes()
        mirror.remove("s")
        assert client.keys("cdlm:session:blob:*") == []
        mirror.release("s")
        mirror.close()


def test_a_response_is_continued_and_compacted_on_other_replicas(cluster):
    """Responses are sessions in the shared tier: one replica continues what another stored,
    from its cache (no earlier turn prefilled again), and compacts it for a third request."""
    import redis
    from openai import OpenAI

    _, replicas, redis_url = cluster
    a, b = (OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in replicas)
    answer = {"model": "tiny", "max_output_tokens": 8, "temperature": 0}
    first = a.responses.create(input=CONTEXT, **answer)
    second = b.responses.create(input="Which box?", previous_response_id=first.id, **answer)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    compacted = a.responses.compact(
        model="tiny", previous_response_id=second.id, extra_body={"ratio": 4}
    )
    third = b.responses.create(input="Sure?", previous_response_id=compacted.id, **answer)
    assert third.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1
    assert a.responses.retrieve(third.id).output_text == third.output_text
    (_, folder_a), (_, folder_b) = replicas.values()
    assert (folder_b / third.id).is_dir() and (folder_a / third.id).is_dir()  # fetched by a
    # A turn refused after its fork was made is never written, here or in the tier (a
    # delete would leave a tombstone there).
    refused = httpx.post(
        f"{list(replicas)[1]}/v1/responses",
        json={**answer, "input": "x", "previous_response_id": third.id, "max_output_tokens": 10**6},
    )
    assert refused.status_code == 400, refused.text
    assert not redis.Redis.from_url(redis_url).keys("*:gone")
    # Each response names its ancestors' segments: the tier holds every distinct one once.
    held = {
        hashlib.sha256(f.read_bytes()).digest(): f.stat().st_size
        for folder in (folder_a, folder_b)
        for f in folder.glob("*/kv-*.safetensors")
    }
    assert _tier_bytes(redis.Redis.from_url(redis_url)) == sum(held.values())


def test_a_response_one_replica_stored_expires_on_another(tmp_path, tiny_llama_dir):
    """--responses-ttl-hours across replicas: replica b, asked for a response that replica a
    stored and b never held, fetches it from the tier and finds it expired (its age is the
    stored record's, not the fetch's): it answers 404 and removes it from the tier too (a
    tombstone), so that a's own copy yields to that and goes as well."""
    import redis
    from openai import NotFoundError, OpenAI

    from conftest import tiny_app_server

    answer = {"model": "tiny", "max_output_tokens": 8, "temperature": 0}
    # In-process replicas, so that the test sets their TTL once the response is stored: their
    # sweeps (every min(TTL / 2, 60) s of the TTL they started with) never run within it.
    ttl = {"responses_ttl": 3600.0}
    with (
        running_redis(tmp_path) as redis_url,
        tiny_app_server(tiny_llama_dir, tmp_path / "a", sessions_redis=redis_url, **ttl) as a,
        tiny_app_server(tiny_llama_dir, tmp_path / "b", sessions_redis=redis_url, **ttl) as b,
    ):
        (url_a, state_a), (url_b, state_b) = a, b
        client_a, client_b = (
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in (url_a, url_b)
        )
        tier = redis.Redis.from_url(redis_url)
        first = client_a.responses.create(input="Remember", **answer)
        assert tier.exists(f"cdlm:session:{first.id}:meta")
        for state in (state_a, state_b):
            state.settings.responses_ttl = 0.5
        time.sleep(1.0)  # past its TTL
        with pytest.raises(NotFoundError):
            client_b.responses.retrieve(first.id)
        assert not tier.exists(f"cdlm:session:{first.id}:meta")
        assert tier.exists(f"cdlm:session:{first.id}:gone")
        assert not (tmp_path / "b" / first.id).exists()
        assert (tmp_path / "a" / first.id).is_dir()  # a has not been asked yet
        with pytest.raises(NotFoundError):
            client_a.responses.create(input="Again", previous_response_id=first.id, **answer)
        assert not (tmp_path / "a" / first.id).exists()
        assert state_a.sessions.get(first.id) is None
