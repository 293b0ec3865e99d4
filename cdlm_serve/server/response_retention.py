"""How long stored responses are kept.

OpenAI keeps a stored response 30 days; so do we by default (`--responses-ttl-hours`, 0 = until
deleted). `store` is the SDK's default, so without an end every Responses call would stay on
disk and in the session table until the store is full (`--max-sessions`: then every new
response answers 507). A response past its time answers 404 the moment it is asked for (as
`previous_response_id` too), and a sweep removes the expired ones nobody asks for: from memory,
disk and the shared tier, like a DELETE. Each response of a conversation stands alone on disk
(hard-linked segment files), so an expired one takes nothing from those continued from it.
Plain sessions (/v1/sessions) are kept until deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cdlm_serve.engine.sessions import Session
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.session_access import remove
from cdlm_serve.server.state import ServerState

log = logging.getLogger(__name__)

MAX_SWEEP_PERIOD = 60.0  # seconds; shorter for a shorter TTL (half of it)
# Seconds a removal waits for an expired response still in use (a request continuing it since
# before it expired); then it stays for the next sweep, and answers 404 meanwhile.
LOCK_WAIT = 0.5


def expired(session: Session, now: float, ttl: float) -> bool:
    """Whether `session` is a stored response older than `ttl` seconds (0: never)."""
    return ttl > 0 and session.response is not None and now - session.created >= ttl


async def expire(state: ServerState, session: Session) -> bool:
    """Remove an expired response; False where it stays for now (in use past LOCK_WAIT, or the
    shared tier refused)."""
    try:
        await remove(state.session_service, session, LOCK_WAIT)
    except APIError as e:
        log.info("expired response %s not removed yet: %s", session.id, e.message)
        return False
    return True


async def sweep(state: ServerState) -> int:
    """Remove every expired response this replica holds; returns how many went."""
    ttl, now = state.settings.responses_ttl, time.time()
    gone = 0
    for session in state.sessions.all():
        if not session.deleted and expired(session, now, ttl):
            gone += await expire(state, session)
    return gone


async def run(state: ServerState) -> None:
    """Sweep every half TTL (at most every MAX_SWEEP_PERIOD seconds) until cancelled."""
    ttl = state.settings.responses_ttl
    if ttl <= 0:
        return
    period = min(ttl / 2, MAX_SWEEP_PERIOD)
    while True:
        await asyncio.sleep(period)
        try:
            gone = await sweep(state)
        except Exception:  # a sweep that fails must not end the sweeping
            log.exception("sweeping expired responses failed")
            continue
        if gone:
            log.info("removed %d expired response(s)", gone)
