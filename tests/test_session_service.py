"""The session service (engine/sessions/service.py), the one protocol every use of a session
goes through: a write is committed on the way out, any failure inside rolls the session back
to its committed version (or removes one never committed), and a busy session is refused."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from cdlm_serve.engine.sessions import (
    SessionBusy,
    SessionNotFound,
    SessionService,
    SessionStore,
)
from cdlm_serve.models.kv_cache import KVCache

CPU = (torch.device("cpu"), torch.float32)


def random_cache(tokens: int) -> KVCache:
    """A cache of one row holding `tokens` slots of random keys and values (2 layers)."""
    cache = KVCache.allocate(2, 1, 2, 8, 64, *CPU)
    for layer in range(2):
        cache.keys[layer][0, :, :tokens] = torch.randn(2, tokens, 8)
        cache.values[layer][0, :, :tokens] = torch.randn(2, tokens, 8)
    cache.lengths[0] = cache.logical[0] = tokens
    return cache


def _grown(service: SessionService, sid: str, tokens: list[int]) -> None:
    """Commit a session whose cache holds `tokens` (random keys and values)."""
    session = service.store.get(sid) or service.store.create("tiny", sid)

    async def write() -> None:
        async with service.open(session, write=True):
            session.rewrite(random_cache(len(tokens)), tokens)

    asyncio.run(write())


def _meta_tokens(store: SessionStore, sid: str) -> int:
    return len(json.loads((store.root / sid / "meta.json").read_text())["tokens"])


class Boom(Exception):
    pass


def test_a_write_is_committed_and_a_failure_inside_rolls_it_back(tmp_path):
    service = SessionService(SessionStore(tmp_path, 1 << 30))
    _grown(service, "s", list(range(10)))
    session = service.store.get("s")
    assert session is not None and session.version is not None
    assert _meta_tokens(service.store, "s") == 10

    async def failing_append() -> None:
        async with service.open(session, write=True, load=CPU):
            session.rewrite(random_cache(15), list(range(15)))
            raise Boom

    with pytest.raises(Boom):
        asyncio.run(failing_append())
    # As it was: in memory (its cache read back from disk when next used) and on disk.
    assert list(session.tokens) == list(range(10)) and not session.lock.locked()
    assert _meta_tokens(service.store, "s") == 10

    async def read() -> int:
        async with service.open(session, load=CPU):
            assert session.cache is not None
            return session.cache.lengths[0]

    assert asyncio.run(read()) == 10


def test_a_session_never_committed_goes_whole_on_a_failure(tmp_path):
    service = SessionService(SessionStore(tmp_path, 1 << 30))
    session = service.store.create("tiny", "new")

    async def failing_create() -> None:
        async with service.open(session, write=True):
            raise Boom

    with pytest.raises(Boom):
        asyncio.run(failing_create())
    assert service.store.get("new") is None and not (tmp_path / "new").exists()
    with pytest.raises(SessionNotFound):
        asyncio.run(service.find("new"))


def test_a_held_session_is_busy_for_another_open(tmp_path):
    service = SessionService(SessionStore(tmp_path, 1 << 30), lock_wait=0.05)
    _grown(service, "s", [1, 2, 3])
    session = service.store.get("s")

    async def both() -> None:
        async with service.open(session):
            with pytest.raises(SessionBusy, match="is busy here"):
                async with service.open(session):
                    pass

    asyncio.run(both())
    assert not session.lock.locked()


def test_a_cache_that_cannot_be_read_back_is_a_read_error_not_a_full_disk(tmp_path, monkeypatch):
    """A read that fails (EIO, a file gone) is no 507 'out of space': the server answers 500,
    and the session stays as committed."""
    import errno

    from cdlm_serve.engine.sessions import SessionReadError

    service = SessionService(SessionStore(tmp_path, 1 << 30))
    _grown(service, "s", [1, 2, 3])
    session = service.store.get("s")

    def unreadable(*_):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(service.store, "load", unreadable)

    async def read() -> None:
        async with service.open(session, load=CPU):
            pass

    with pytest.raises(SessionReadError, match="could not be read back"):
        asyncio.run(read())
    assert list(session.tokens) == [1, 2, 3] and not session.lock.locked()
