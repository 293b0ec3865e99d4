"""Sessions: a model's KV cache for a conversation or a document, kept between requests.

What the server and the engines use is exported here: `Session` and its id rule, the store
that holds sessions in memory and on disk (`SessionStore`), the Redis tier that shares them
between replicas (`SessionMirror`), and the one protocol every user of a session goes through
(`SessionService.open`: lock, lease, load, then commit or roll back). Inside: `files` (versions on
disk, written atomically), `segment_tensors` and `ragged` (a compacted segment's tensors),
`packed_cache` (an idle session's cache in memory), `mirror`, `store`, `session`.
"""

from cdlm_serve.engine.sessions.mirror import MirrorError, SessionConflict, SessionMirror
from cdlm_serve.engine.sessions.packed_cache import PackedCache
from cdlm_serve.engine.sessions.service import (
    SessionBusy,
    SessionNotFound,
    SessionReadError,
    SessionService,
    unstoppable,
)
from cdlm_serve.engine.sessions.session import (
    SESSION_ID_PATTERN,
    Session,
    SessionError,
    check_id,
)
from cdlm_serve.engine.sessions.store import SessionStore

__all__ = [
    "SESSION_ID_PATTERN",
    "MirrorError",
    "PackedCache",
    "Session",
    "SessionBusy",
    "SessionConflict",
    "SessionError",
    "SessionMirror",
    "SessionNotFound",
    "SessionReadError",
    "SessionService",
    "SessionStore",
    "check_id",
    "unstoppable",
]
