"""OpenAI's Responses API on the session store: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`, `POST /v1/responses/compact`.

A stored response is a session (`engine/sessions/session.py`) whose id is the response's and whose
committed version carries the response's record (`Session.response`: status, output, usage).
Its cache holds the whole conversation up to the end of its answer, so a request with
`previous_response_id` continues from that cache and feeds the model only the new turn
(`server.response_input.continuation_ids`). The new response is a fork of the previous one
(`SessionStore.fork`): the cache moves to it and its first commit hard-links the previous
response's segment files, so every response of a conversation stays whole and can be continued
again (branches), while a turn costs only its own tokens on disk and in compute. `store: false`
writes nothing: it continues the previous response's cache without changing it (or, with no
previous response, is a stateless chat). Compaction (`/v1/responses/compact`) forks the
previous response and compacts the fork with Attention Matching: its id is the compacted
state to continue from. Through the Redis tier (`engine/sessions/mirror.py`) responses reach
every replica as sessions do.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import Session, SessionError
from cdlm_serve.server import planning, response_retention, streaming
from cdlm_serve.server.compactions import compact, compaction_spec
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.planning import (
    Choice,
    UsageCount,
    prefill_session,
    record,
    run_choices,
    usage,
)
from cdlm_serve.server.response_input import (
    INPUT_ITEMS,
    Turn,
    continuation_ids,
    first_prompt,
    input_items,
    items_page,
    parse_input,
    prompt_text,
)
from cdlm_serve.server.response_output import Added, Output, text_part
from cdlm_serve.server.response_schemas import ResponseCompactRequest, ResponseCreateRequest
from cdlm_serve.server.routes.sessions import auto_compact_policy, using
from cdlm_serve.server.schemas import (
    SESSION_ERROR_RESPONSES,
    CompletionRequest,
)
from cdlm_serve.server.session_access import (
    bytes_per_token,
    catch_up,
    find,
    load_cache,
    opened,
    persist,
    remove,
    session_error,
    unstoppable,
)
from cdlm_serve.server.state import ServerState, State
from cdlm_serve.server.tool_calls import ToolUse, response_tools, tool_use
from cdlm_serve.server.tool_format import FunctionTool

router = APIRouter()
DEFAULT_COMPACT_RATIO = 2.0  # what /v1/responses/compact does without ratio or target_tokens


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- finding --------------------------------------------------------------------------------
def _chat_model(state: ServerState, name: str) -> ServedModel:
    served = state.get(name)
    if served.is_diffusion:
        raise APIError(400, "the Responses API serves autoregressive models", param="model")
    return served


def _not_found(rid: str, param: str) -> APIError:
    return APIError(404, f"response {rid!r} not found", param=param, code="response_not_found")


async def _stored(state: ServerState, rid: str, param: str) -> Session:
    """The stored response `rid` (404 if there is none: a session that is not a response is
    not one either)."""
    try:
        session = await find(state, rid, param)
    except APIError as e:
        raise (_not_found(rid, param) if e.status == 404 else e) from None
    if session.response is None:
        raise _not_found(rid, param)
    if response_retention.expired(session, time.time(), state.settings.responses_ttl):
        await response_retention.expire(state, session)  # (404 either way)
        raise _not_found(rid, param)
    return session


def _instructions(stored: Session) -> str | None:
    """The instructions a stored response's conversation holds in its cache."""
    value = (stored.response or {}).get("instructions")
    return value if isinstance(value, str) else None


def _tools(stored: Session) -> list[FunctionTool]:
    """The tools a stored response showed its model (in its cache): its tools, unless its
    `tool_choice` was "none" (not shown)."""
    record = stored.response or {}
    return [] if record.get("tool_choice") == "none" else response_tools(record.get("tools"))


def _previous(given: str | None, turn: Turn) -> str | None:
    """The response to continue: `previous_response_id`, or the compaction item in the
    input (the two must agree)."""
    if given is not None and turn.compacted is not None and given != turn.compacted:
        raise APIError(
            400,
            "previous_response_id and the input's compaction item name different responses",
            param="previous_response_id",
        )
    return given or turn.compacted


# ---- the record -----------------------------------------------------------------------------
@dataclass(slots=True)
class Answer:
    """What the engine produced for one response, and what its record says."""

    id: str
    req: ResponseCreateRequest
    model: str
    previous: str | None
    # In effect: the request's, or the stored conversation's (in its cache) without new ones.
    instructions: str | None = None
    history: int = 0  # tokens of the conversation already in the cache
    choices: list[Choice] = field(default_factory=list)
    tally: UsageCount = field(default_factory=UsageCount)
    output: Output = field(default_factory=lambda: Output(None))  # its message and calls
    finish: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def usage(self) -> dict[str, Any]:
        fed = len(self.choices[0].prompt_ids) if self.choices else 0
        cached = self.history + self.tally.cached.get(0, 0)
        out = self.tally.completion_tokens
        return {
            "input_tokens": self.history + fed,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.history + fed + out,
        }

    def body(self, done: bool) -> dict[str, Any]:
        """The response object (OpenAI's fields), in progress or finished."""
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status if done else "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if done and self.status == "incomplete" else None
            ),
            "instructions": self.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": self.output.bodies(self.status) if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": self.previous,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": self.usage() if done else None,
            "user": req.user,
        }


# ---- POST /v1/responses ----------------------------------------------------------------------
@router.post(
    "/v1/responses",
    operation_id="create_response",
    responses={**SESSION_ERROR_RESPONSES, 409: SESSION_ERROR_RESPONSES[400]},
    response_model=None,
)
async def create_response(req: ResponseCreateRequest, request: Request, state: State) -> Response:
    served = _chat_model(state, req.model)
    unsupported = req.unsupported()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server", param=unsupported)
    tools = tool_use(served, response_tools(req.tools), req.tool_choice, req.parallel_tool_calls)
    turn = parse_input(req.input, req.instructions)
    turn.tools = tools.offered if tools is not None else []
    previous = _previous(req.previous_response_id, turn)
    if previous is not None and req.auto_compact is not None:
        raise APIError(
            400, "auto_compact is set by a conversation's first response", param="auto_compact"
        )
    events = _respond(state, served, req, turn, previous, request, tools)
    return await streaming.answer_when_admitted(events, req.stream)


def _completion(req: ResponseCreateRequest, ids: list[int], append: bool) -> CompletionRequest:
    """The request as the planner takes it (its sampling, limits and extensions)."""
    return CompletionRequest.model_validate(
        {
            "model": req.model,
            "prompt": ids,
            "max_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "ignore_eos": req.ignore_eos,
            "cache_salt": req.cache_salt,
            "stream": req.stream,
            "append": append,
            "response_format": req.response_format(),
        }
    )


async def _respond(
    state: ServerState,
    served: ServedModel,
    req: ResponseCreateRequest,
    turn: Turn,
    previous: str | None,
    request: Request,
    tools: ToolUse | None,
) -> AsyncGenerator[Any, None]:
    """Yields None once admitted (sessions found and locked, the turn planned), then the
    response body or its stream's events."""
    parent = None if previous is None else await _stored(state, previous, "previous_response_id")
    instructions = req.instructions
    if instructions is None and parent is not None:
        instructions = _instructions(parent)
    answer = Answer(_new_id("resp"), req, served.name, previous, instructions)
    answer.output = Output(tools.parser() if tools is not None else None)
    forced = tools.grammar() if tools is not None else None
    if parent is not None and parent.model != served.name:
        raise APIError(
            400, f"response {previous!r} belongs to model {parent.model!r}", param="model"
        )
    if not req.store and parent is None:  # a stateless chat: no session at all
        answer.choices = planning.plan_completion(
            served, _completion(req, first_prompt(served, turn), False), forced
        )
        yield None
        async for out in _answer(state, served, answer, request, None):
            yield out
        return
    made: list[Session] = []  # the response's own session, once made (ours to discard)
    try:
        session = parent
        if req.store:
            session = await _open(state, served, parent, answer.id, req, made)
        assert session is not None

        def keep() -> bool:  # a response never finished is removed, never written
            return not req.store or session.response is not None

        async with using(state, served, session, keep):
            await load_cache(state, served, session)
            answer.history = session.logical_length
            ids = (
                first_prompt(served, turn)
                if parent is None
                else continuation_ids(
                    served, turn, session.next_input, _instructions(parent), _tools(parent)
                )
            )
            creq = _completion(req, ids, req.store)
            answer.choices = planning.plan_session(served, creq, session, forced)
            if req.store:
                grows = len(answer.choices[0].prompt_ids) + answer.choices[0].params.max_tokens
                try:
                    state.sessions.check_room(grows * bytes_per_token(served))
                except SessionError as e:
                    raise session_error(e, "input") from None
            yield None
            stored = session if req.store else None
            async for out in _answer(state, served, answer, request, stored):
                yield out
    finally:
        for own in made:  # failed before `using` took it (which removes it otherwise)
            if own.response is None and not own.deleted:
                await _discard(state, own)


async def _open(
    state: ServerState,
    served: ServedModel,
    parent: Session | None,
    rid: str,
    req: ResponseCreateRequest,
    made: list[Session],
) -> Session:
    """The session the new response is stored as (in the table, not yet on disk, added to
    `made` the moment it exists): a fork of the previous response, or a new one."""
    if parent is not None:
        return await _open_fork(state, served, parent, rid, made)
    policy = auto_compact_policy(req.auto_compact, served)
    try:
        session = state.sessions.create(served.name, rid, fresh=True)
    except SessionError as e:
        raise session_error(e, "input") from None
    made.append(session)
    session.auto_compact = policy
    return session


async def _discard(state: ServerState, session: Session) -> None:
    """Remove a response that failed before it was stored whole."""
    await remove(state.session_service, session, state.settings.session_lock_wait)


async def _answer(
    state: ServerState,
    served: ServedModel,
    answer: Answer,
    request: Request,
    session: Session | None,
) -> AsyncIterator[Any]:
    """Run the planned turn: its response body, or its stream's events; a stored response is
    committed (its record with its cache) before the client hears it is complete."""
    if not answer.req.stream:
        await streaming.until_disconnected(request, _generate(state, served, answer))
        await _commit(state, answer, session)
        yield answer.body(True)
        return
    async for event in _events(state, served, answer, session):
        yield event


async def _generate(state: ServerState, served: ServedModel, answer: Answer) -> None:
    async for out in _outputs(state, served, answer):
        del out


async def _outputs(
    state: ServerState, served: ServedModel, answer: Answer
) -> AsyncIterator[list[Added]]:
    """What each engine output added to the answer's items (text, calls), as the engine
    produces them, counted into the answer; usage is recorded however it ends (a cancelled
    request counts as an abort)."""
    started = time.perf_counter()
    try:
        async for _, out in run_choices(served, answer.choices):
            answer.tally.add(out, 0)
            answer.finish = out.finish_reason or answer.finish
            yield answer.output.take(out.text, out.finish_reason is not None)
    finally:
        body = usage(served, answer.choices, 1, answer.tally)
        record(state.metrics, served, body, answer.tally, started, 1)


async def _commit(state: ServerState, answer: Answer, session: Session | None) -> None:
    """Store the finished response: its record with the cache the engine wrote back."""
    if session is None:
        return
    if answer.finish not in ("stop", "length"):  # aborted: the engine wrote nothing back
        raise APIError(499, "the response was not finished")
    session.response = {**answer.body(True), INPUT_ITEMS: input_items(answer.req.input)}
    session.dirty = True
    try:
        await persist(state.session_service, session)
    except BaseException:
        session.response = None  # not stored: discarded
        raise


class Events:
    """Server-sent events as OpenAI's Responses stream sends them: a type and a sequence
    number in each."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def error(self, e: APIError) -> str:
        # OpenAI's error event (code, message, param), and the error object OpenAI's SDK
        # raises from a stream.
        detail = {"message": e.message, "type": "invalid_request_error", "param": e.param}
        return self("error", code=e.code, message=e.message, param=e.param, error=detail)


async def _events(
    state: ServerState, served: ServedModel, answer: Answer, session: Session | None
) -> AsyncIterator[str]:
    event = Events()
    yield event("response.created", response=answer.body(False))
    yield event("response.in_progress", response=answer.body(False))
    for index, item in enumerate(answer.output.items):  # the message of a text-only answer
        for e in _item_events(event, Added(index, item, True)):
            yield e
    try:
        async for added in _outputs(state, served, answer):
            for piece in added:
                for e in _item_events(event, piece):
                    yield e
        await _commit(state, answer, session)
    except APIError as e:
        yield event.error(e)
        return
    message = answer.output.message
    if message is not None:
        at = answer.output.items.index(message)
        where = {"item_id": message.id, "output_index": at, "content_index": 0}
        yield event("response.output_text.done", **where, text=message.text, logprobs=[])
        yield event("response.content_part.done", **where, part=text_part(message.text))
        body = message.body(answer.status)
        yield event("response.output_item.done", output_index=at, item=body)
    yield event(f"response.{answer.status}", response=answer.body(True))


def _item_events(event: Events, added: Added) -> list[str]:
    """The stream's events for what one piece of the answer added: a new message (its item
    and its first content part), text in it, or a whole function call (its arguments in one
    delta)."""
    item, index = added.item, added.index
    out = []
    if added.new:
        out.append(
            event("response.output_item.added", output_index=index, item=item.body("in_progress"))
        )
    if item.call is None:
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if added.new:
            out.append(event("response.content_part.added", **where, part=text_part("")))
        if added.text:
            out.append(event("response.output_text.delta", **where, delta=added.text, logprobs=[]))
        return out
    where = {"item_id": item.id, "output_index": index}
    arguments = item.call.arguments
    out.append(event("response.function_call_arguments.delta", **where, delta=arguments))
    out.append(event("response.function_call_arguments.done", **where, arguments=arguments))
    out.append(event("response.output_item.done", output_index=index, item=item.body("completed")))
    return out


# ---- GET / DELETE /v1/responses/{id} ---------------------------------------------------------
@router.get(
    "/v1/responses/{rid}",
    operation_id="get_response",
    responses=SESSION_ERROR_RESPONSES,
    response_model=None,
)
async def get_response(rid: str, state: State) -> dict[str, Any]:
    session = await _stored(state, rid, "response_id")
    await catch_up(state.session_service, session)
    if session.response is None:  # replaced meanwhile by a copy that is not a response
        raise _not_found(rid, "response_id")
    return {k: v for k, v in session.response.items() if k != INPUT_ITEMS}


@router.get(
    "/v1/responses/{rid}/input_items",
    operation_id="list_input_items",
    responses=SESSION_ERROR_RESPONSES,
    response_model=None,
)
async def list_input_items(
    rid: str,
    state: State,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = Query(None, max_length=128),
) -> dict[str, Any]:
    """The input items the response was created with (OpenAI's list: newest first unless
    `order=asc`, `limit` a page, `after` an item id). A response stored before the server kept
    them lists none."""
    session = await _stored(state, rid, "response_id")
    await catch_up(state.session_service, session)
    if session.response is None:
        raise _not_found(rid, "response_id")
    return items_page(session.response.get(INPUT_ITEMS, []), limit, order, after)


@router.delete(
    "/v1/responses/{rid}",
    operation_id="delete_response",
    responses=SESSION_ERROR_RESPONSES,
    response_model=None,
)
async def delete_response(rid: str, state: State) -> dict[str, Any]:
    session = await _stored(state, rid, "response_id")
    await remove(state.session_service, session, state.settings.session_lock_wait)
    return {"id": rid, "object": "response", "deleted": True}


# ---- POST /v1/responses/compact --------------------------------------------------------------
@router.post(
    "/v1/responses/compact",
    operation_id="compact_response",
    responses={**SESSION_ERROR_RESPONSES, 409: SESSION_ERROR_RESPONSES[400]},
    response_model=None,
)
async def compact_response(req: ResponseCompactRequest, state: State) -> dict[str, Any]:
    served = _chat_model(state, req.model)
    spec = compaction_spec(req, default_ratio=DEFAULT_COMPACT_RATIO)
    turn = parse_input(req.input, req.instructions)
    previous = _previous(req.previous_response_id, turn)
    if previous is not None and turn.messages:
        raise APIError(
            400,
            "a compaction of a stored response takes no new input: send it with the next "
            "POST /v1/responses",
            param="input",
        )
    rid = _new_id("resp")
    parent = None
    if previous is not None:
        parent = await _stored(state, previous, "previous_response_id")
        if parent.model != served.name:
            raise APIError(
                400, f"response {previous!r} belongs to model {parent.model!r}", param="model"
            )
    made: list[Session] = []
    try:
        if parent is not None:
            instructions = _instructions(parent)
            if req.instructions not in (None, instructions):
                raise APIError(
                    400,
                    "a compaction of a stored response keeps its instructions (they are in "
                    "its cache): send new ones with the next POST /v1/responses",
                    param="instructions",
                )
            session = await _open_fork(state, served, parent, rid, made)
        else:
            session = await _prefilled(state, served, turn, rid, made)
            instructions = req.instructions
        body = _compaction_body(rid, served.name, previous, instructions, session)
        async with state.compactions.slot():
            session.response = body
            report = await unstoppable(compact(state, served, session, spec))
    except BaseException:  # not compacted: as if never made
        for own in made:
            if not own.deleted:
                await _discard(state, own)
        raise
    return {**body, "compaction": report}


def _compaction_body(
    rid: str, model: str, previous: str | None, instructions: str | None, session: Session
) -> dict[str, Any]:
    """OpenAI's compacted response: its id (and the compaction item's content) is the stored
    response to continue from."""
    before = 0 if session.cache is None else session.cache.lengths[0]
    return {
        "id": rid,
        "object": "response.compaction",
        "created_at": int(time.time()),
        "model": model,
        "previous_response_id": previous,
        "instructions": instructions,  # the conversation's, in its cache
        "output": [
            {
                "id": _new_id("cmp"),
                "type": "compaction",
                # Not encrypted: the stored response to continue from (ours stay on the server).
                "encrypted_content": rid,
                "created_by": "cdlm-serve",
            }
        ],
        "usage": {
            "input_tokens": before,
            "input_tokens_details": {"cached_tokens": before if previous else 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": before,
        },
    }


async def _open_fork(
    state: ServerState, served: ServedModel, parent: Session, rid: str, made: list[Session]
) -> Session:
    """A fork of `parent` (under its lock), added to `made` the moment it exists: a request
    cancelled while it gives the parent's lock back still discards it."""
    async with opened(state, parent, served=served, param="previous_response_id"):
        made.append(state.sessions.fork(parent, rid))
        return made[-1]


async def _prefilled(
    state: ServerState, served: ServedModel, turn: Turn, rid: str, made: list[Session]
) -> Session:
    """A new session holding the input conversation (up to the end of its last answer, where
    the next turn continues), added to `made` the moment it exists."""
    ids = prompt_text(served, turn)
    store = state.sessions
    try:
        store.check_room(len(ids) * bytes_per_token(served))
        session = store.create(served.name, rid, fresh=True)
    except SessionError as e:
        raise session_error(e, "input") from None
    made.append(session)
    async with opened(state, session):  # committed by the compaction that follows
        await prefill_session(served, session, ids)
    return session
