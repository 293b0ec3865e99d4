"""A session: a model's KV cache for a conversation or document, kept between requests, with
the token history its cache holds, the last sampled token not yet run through the model, and
the compactions applied; and the one rule for session ids (`SESSION_ID`). The store that keeps
sessions in memory and on disk is `engine/sessions/store.py`."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cdlm_serve.engine.compaction import AutoCompact, QuantizedSegment
from cdlm_serve.engine.sessions.files import Version
from cdlm_serve.engine.sessions.packed_cache import PackedCache
from cdlm_serve.models.kv_cache import KVCache

# The one rule for session ids: ASCII letters and digits, then also '_' and '-', 1-128 long.
# No dots (so never '.', '..' or a hidden name), no separators, nothing a filesystem reads.
SESSION_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}"
SESSION_ID = re.compile(SESSION_ID_PATTERN)
SESSION_ID_RULE = "1-128 characters of A-Z a-z 0-9 _ -, starting with a letter or digit"


class SessionError(ValueError):
    """A request about sessions that cannot be done; `status` is its HTTP status."""

    status = 400


class SessionExists(SessionError):
    status = 409


class SessionLimit(SessionError):
    """The store is full (sessions or disk); 507 Insufficient Storage."""

    status = 507


def check_id(sid: Any) -> str:
    if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
        raise SessionError(f"invalid session id: it must be {SESSION_ID_RULE}")
    return sid


@dataclass(eq=False)
class Session:
    id: str
    model: str
    tokens: list[int]  # history whose K/V the cache holds, in order
    cache: KVCache | None  # None while it lives on disk only (or has no tokens yet)
    next_input: int | None = None  # last sampled token, not yet in the cache
    compactions: list[dict[str, Any]] = field(default_factory=list)
    auto_compact: AutoCompact | None = None  # compacts itself past a size (auto_compaction)
    auto_pending: bool = False  # an online compaction is due and not yet done
    # The compacted segment as int8 codes (engine.compaction.kv_quant), if the compaction quantized
    # it, and, while the session is idle, its cache packed (engine.sessions.packed_cache: without
    # the padding of non-uniform budgets, the codes instead of their values; codes then None).
    codes: QuantizedSegment | None = None
    packed: PackedCache | None = None
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Serializes writes of this session: a write whose request was cancelled may still be
    # running on its thread when the next one starts.
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    # What is on disk: the committed version, and how many leading slots of `cache` it holds
    # unchanged (an append writes only the slots after them).
    version: Version | None = None
    disk_slots: int = 0
    dirty: bool = True  # the session differs from its committed version
    # A fork (`SessionStore.fork`) not yet committed: the committed version of the session it
    # was forked from, whose segments its first commit links instead of writing them again.
    base: Version | None = None
    # The Responses API's record, if this session is a stored response (its id is the
    # session's): status, output, usage (server/routes/responses.py).
    response: dict[str, Any] | None = None
    deleted: bool = False  # removed from the store: never written again

    @property
    def logical_length(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes()
        return 0 if self.cache is None else self.cache.allocated_bytes()

    # ---- changes (the caller holds the lock) -----------------------------------------------
    def extend(self, cache: KVCache, new_tokens: list[int], next_input: int | None) -> None:
        """A completion appended `new_tokens` to the history: `cache` holds the old slots
        unchanged, then theirs."""
        self.cache = cache
        self.tokens = self.tokens + new_tokens
        self.next_input = next_input
        self.dirty = True

    def rewrite(
        self,
        cache: KVCache,
        tokens: list[int] | None = None,
        codes: QuantizedSegment | None = None,
    ) -> None:
        """Every slot changed (a prefill from scratch, a compaction; its first slots maybe
        quantized, `codes`)."""
        self.cache = cache
        self.codes = codes
        if tokens is not None:
            self.tokens = tokens
        self.disk_slots = 0
        self.dirty = True

    def describe(self) -> dict[str, Any]:
        cache = self.cache
        physical = cache.lengths[0] if cache is not None else None
        if physical is None and self.packed is not None:
            physical = self.packed.length
        if physical is None and self.version is not None:
            physical = self.version.length
        quantized = self.codes.slots if self.codes is not None else None
        if self.packed is not None and self.packed.quantized:
            quantized = self.packed.quantized
        return {
            "id": self.id,
            "object": "session",
            "model": self.model,
            "created": int(self.created),
            "tokens": len(self.tokens) + (self.next_input is not None),
            "logical_length": self.logical_length,
            "physical_tokens": physical,
            "bytes": self.nbytes(),
            "disk_bytes": 0 if self.version is None else self.version.disk_bytes,
            "in_memory": cache is not None or self.packed is not None,
            "quantized_tokens": quantized,
            "compactions": self.compactions,
            "auto_compact": None if self.auto_compact is None else self.auto_compact.to_json(),
            "auto_compact_pending": self.auto_pending,
        }


def from_version(version: Version) -> Session:
    """A committed version as a session in the table (its cache stays on disk until used)."""
    session = Session(version.id, version.model, [], None)
    take_version(session, version)
    return session


def take_version(session: Session, version: Version) -> None:
    session.tokens = list(version.tokens)
    session.cache = None  # read from the version's files when next used
    session.codes = session.packed = None  # so are the codes, if its first segment holds them
    session.next_input = version.next_input
    session.compactions = list(version.compactions)
    session.auto_compact = AutoCompact.from_json(version.auto_compact)
    session.response = version.response
    session.created = version.created
    session.version = version
    session.disk_slots = version.length
    session.dirty = False
