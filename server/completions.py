"""POST /v1/completions: turn a request into engine work, and its output into OpenAI's
response (one JSON body) or its server-sent-event stream.

The pieces here are shared with chat completions (`server/chat.py`): `plan_choices` (prompts x
n samples -> engine parameters, with every limit checked up front), `run_choices` (all choices
of a request submitted at once, so the engine batches them, their outputs merged as they come)
and `UsageCount` (usage). AR models stream one chunk per token, diffusion models one per completed
block and report `usage.steps`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from engine import model_work
from engine.dlm_engine import DLMParams
from engine.engine_thread import QueueFull
from engine.interface import EngineOutput
from engine.sampling import SamplingParams
from engine.served_model import ServedModel
from engine.session_store import Session
from server.errors import APIError, error_body
from server.metrics import Metrics
from server.request_limits import MAX_CHOICES
from server.schemas import CompletionRequest

DLM_OPTIONS = ("decoding", "block_size", "threshold")


@dataclass(slots=True)
class Choice:
    """One (prompt, sample) pair of a request: `n` choices per prompt, in OpenAI's order."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams | DLMParams
    session: Session | None = None  # continue from this session's cache
    append: bool = True


@dataclass(slots=True)
class UsageCount:
    """What a request produced, for usage and metrics."""

    completion_tokens: int = 0
    steps: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, out: EngineOutput) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.finish_reason is not None:
            self.reasons.append(out.finish_reason)
            self.steps += out.steps or 0


# ---- planning --------------------------------------------------------------------------------
def reject_unsupported(served: ServedModel, req: Any, unsupported: dict[str, bool]) -> None:
    if served.is_diffusion:
        if any(unsupported.get(k) for k in ("logprobs", "top_logprobs")):
            unsupported["logprobs"] = True  # diffusion decoding has no per-token distribution
    else:
        unsupported |= {k: getattr(req, k, None) is not None for k in DLM_OPTIONS}
    for param, used in unsupported.items():
        if used:
            reason = "only for diffusion models" if param in DLM_OPTIONS else "by this server yet"
            if param == "logprobs" and served.is_diffusion:
                reason = "for diffusion models"
            raise APIError(400, f"{param} is not supported {reason}", param=param)


def encode(served: ServedModel, text: str, param: str = "prompt") -> list[int]:
    try:
        return served.encode(text)
    except ValueError as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from None


def prompt_ids(served: ServedModel, prompt: Any) -> list[tuple[list[int], str]]:
    """Each prompt of a request (string, list of strings, token ids, list of id lists) as
    (token ids, text)."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    vocab = served.config.vocab_size
    out = []
    for p in items:
        if isinstance(p, str):
            ids = encode(served, p)
            if not ids and served.config.bos_token_id is not None:
                ids = [int(served.config.bos_token_id)]
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            out.append((ids, p))
        else:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
                )
            out.append((list(p), served.tokenizer.decode(p)))
    return out


def _context_error(limit: int, prompt: int, wanted: int, note: str = "") -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + wanted} tokens ({prompt} in the prompt, {wanted} in the completion{note}). "
        "Please reduce the prompt or max_tokens.",
        param="max_tokens",
        code="context_length_exceeded",
    )


def _params(served: ServedModel, req: Any, max_tokens: int, seed: int | None, logprobs: int | None):
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    stop = list(req.stop or [])
    if not served.is_diffusion:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            logprobs=logprobs,
            ignore_eos=req.ignore_eos,
        )
    engine = served.engine
    return DLMParams(
        max_tokens=max_tokens,
        decoding=req.decoding or "cdlm",
        block_size=req.block_size or engine.block_size,
        threshold=engine.threshold if req.threshold is None else req.threshold,
        # Diffusion decoding is greedy unless the request sets a temperature itself.
        temperature=temperature if "temperature" in req.model_fields_set else 0.0,
        top_p=top_p,
        seed=seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
    )


def plan_choices(
    served: ServedModel,
    req: Any,
    prompts: list[tuple[list[int], str]],
    max_tokens: int | None,
    logprobs: int | None,
) -> list[Choice]:
    limit = served.max_model_len
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={req.n} is more than {MAX_CHOICES} choices per request",
            param="n",
        )
    choices = []
    for i, (ids, text) in enumerate(prompts):
        room = limit - len(ids)
        wanted = max_tokens if max_tokens is not None else room
        if wanted > room or room < 1:
            raise _context_error(limit, len(ids), wanted)
        for j in range(req.n):
            seed = None if req.seed is None else req.seed + j
            params = _params(served, req, wanted, seed, logprobs)
            if isinstance(params, DLMParams):
                # The engine decodes whole blocks: the rounded-up budget must fit too.
                budget = math.ceil(wanted / params.block_size) * params.block_size
                if budget > room:
                    raise _context_error(
                        limit, len(ids), budget, ", max_tokens rounded up to whole blocks"
                    )
            choices.append(Choice(i * req.n + j, ids, text, params))
    return choices


def plan_completion(served: ServedModel, req: CompletionRequest) -> list[Choice]:
    reject_unsupported(
        served,
        req,
        {
            "suffix": req.suffix is not None,
            "best_of": req.best_of is not None and req.best_of != req.n,
            "presence_penalty": req.presence_penalty != 0.0,
            "frequency_penalty": req.frequency_penalty != 0.0,
            "logprobs": served.is_diffusion and req.logprobs is not None,
        },
    )
    return plan_choices(served, req, prompt_ids(served, req.prompt), req.max_tokens, req.logprobs)


def plan_session(served: ServedModel, req: CompletionRequest, session: Session) -> list[Choice]:
    """One choice continuing from a session: the session's next input token (sampled last time,
    never run through the model) comes first."""
    reject_unsupported(
        served,
        req,
        {"echo": req.echo, "logprobs": req.logprobs is not None, "suffix": req.suffix is not None},
    )
    ((ids, text),) = prompt_ids(served, req.prompt)
    if session.next_input is not None:
        ids = [session.next_input, *ids]
    room = served.max_model_len - session.logical_length - len(ids)
    wanted = req.max_tokens if req.max_tokens is not None else room
    if wanted > room or room < 1:
        raise _context_error(served.max_model_len, session.logical_length + len(ids), wanted)
    params = _params(served, req, wanted, req.seed, None)
    return [Choice(0, ids, text, params, session, req.append)]


# ---- running ---------------------------------------------------------------------------------
async def run_choice(served: ServedModel, choice: Choice) -> AsyncIterator[Any]:
    """The engine outputs of one choice, in order; the last carries the finish reason."""

    def build(request_id: str, aborted: Callable[[], bool]) -> Any:
        return served.engine.new_sequence(
            request_id, choice.prompt_ids, choice.params, aborted, choice.session, choice.append
        )

    try:
        async for out in served.thread.stream(build):
            yield out
    except QueueFull as e:
        raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
    except ValueError as e:  # the engine refused the request (limits it checks itself)
        raise APIError(400, str(e)) from None


async def run_choices(served: ServedModel, choices: list[Choice]) -> AsyncIterator[tuple[int, Any]]:
    """All choices at once (the engine batches them); (choice index, output) as they come."""
    if len(choices) == 1:
        async for out in run_choice(served, choices[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, choice: Choice) -> None:
        try:
            async for out in run_choice(served, choice):
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:  # the client went away or a choice failed: stop the others too
            t.cancel()


def new_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(served: ServedModel, choices: list[Choice], n: int, tally: UsageCount) -> dict:
    # Each prompt counts once, however many samples were drawn from it (OpenAI's accounting).
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[::n])
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tally.completion_tokens,
        "total_tokens": prompt_tokens + tally.completion_tokens,
    }
    if served.is_diffusion:
        body["steps"] = tally.steps
    return body


def record(
    metrics: Metrics | None,
    served: ServedModel,
    body: dict,
    tally: UsageCount,
    started: float,
    n_choices: int,
) -> None:
    """Count a finished request; one whose choices did not all finish was aborted."""
    if metrics is None:
        return
    complete = len(tally.reasons) == n_choices and "abort" not in tally.reasons
    reason = tally.reasons[-1] if complete else "abort"
    metrics.observe_request(
        served.name,
        body["prompt_tokens"],
        body["completion_tokens"],
        reason,
        time.perf_counter() - started,
    )


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# ---- logprobs in the legacy completions shape -------------------------------------------------
@dataclass(slots=True)
class LegacyLogprobs:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}, built up as tokens come."""

    tokenizer: Any
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        text = self.tokenizer.decode([token])
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(
            None if top is None else {self.tokenizer.decode([t]): lp for t, lp in top}
        )
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def add_outputs(self, logprobs: list[Any]) -> None:
        for lp in logprobs:
            self.add(lp.token, lp.logprob, lp.top)

    def body(self, start: int = 0) -> dict:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts its engine
    sequences) instead of finishing an answer nobody will read."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            raise APIError(499, "client closed the request")
    return task.result()


# ---- the two response forms -------------------------------------------------------------------
async def complete(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> dict:
    started = time.perf_counter()
    tally = UsageCount()
    texts: dict[int, list[str]] = {
        i: [c.prompt_text] if req.echo else [] for i, c in enumerate(choices)
    }
    finish: dict[int, str | None] = dict.fromkeys(range(len(choices)))
    logprobs = {i: await _start_logprobs(served, req, c) for i, c in enumerate(choices)}
    async for i, out in run_choices(served, choices):
        texts[i].append(out.text)
        tally.add(out)
        finish[i] = out.finish_reason or finish[i]
        if logprobs[i] is not None:
            logprobs[i].add_outputs(out.logprobs)
    body = usage(served, choices, req.n, tally)
    record(metrics, served, body, tally, started, len(choices))
    return {
        "id": new_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": [
            {
                "index": c.index,
                "text": "".join(texts[i]),
                "logprobs": None if logprobs[i] is None else logprobs[i].body(),
                "finish_reason": finish[i],
            }
            for i, c in enumerate(choices)
        ],
        "usage": body,
    }


async def _start_logprobs(
    served: ServedModel, req: CompletionRequest, choice: Choice
) -> LegacyLogprobs | None:
    if req.logprobs is None:
        return None
    lp = LegacyLogprobs(served.tokenizer)
    if req.echo:  # the prompt's own logprobs: model work, in pieces on the engine thread
        scored = await asyncio.to_thread(
            model_work.prompt_logprobs,
            served.model,
            choice.prompt_ids,
            req.logprobs,
            served.thread.run,
        )
        for p in scored:
            lp.add(p.token, p.logprob, p.top)
    return lp


@dataclass(slots=True)
class StreamHead:
    """What every chunk of one stream carries besides its choice."""

    id: str
    object: str  # "text_completion" | "chat.completion.chunk"
    created: int
    model: str
    include_usage: bool  # every chunk says "usage": null, the last one the usage

    @classmethod
    def new(cls, served: ServedModel, req: Any, obj: str, prefix: str) -> StreamHead:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return cls(new_id(prefix), obj, int(time.time()), served.name, include_usage)

    def body(self, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict) -> str:
        body = self.body([choice])
        if self.include_usage:
            body["usage"] = None
        return sse(body)


async def framed(
    served: ServedModel,
    req: Any,
    choices: list[Choice],
    metrics: Metrics | None,
    head: StreamHead,
    tally: UsageCount,
    chunks: AsyncIterator[str],
) -> AsyncIterator[str]:
    """A stream's chunks, then its end: an error becomes an error event, usage is counted and
    recorded even when the client goes away (the generator is closed: an abort), then the
    usage chunk if it was asked for, then [DONE]."""
    started = time.perf_counter()
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param, e.code))
    finally:
        body = usage(served, choices, req.n, tally)
        record(metrics, served, body, tally, started, len(choices))
    if head.include_usage:
        yield sse({**head.body([]), "usage": body})
    yield sse("[DONE]")


def stream(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> AsyncIterator[str]:
    head = StreamHead.new(served, req, "text_completion", "cmpl")
    tally = UsageCount()
    return framed(
        served, req, choices, metrics, head, tally, _chunks(served, req, choices, head, tally)
    )


async def _chunks(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    head: StreamHead,
    tally: UsageCount,
) -> AsyncIterator[str]:
    def chunk(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return head.chunk(choice)

    logprobs = {}
    for i, c in enumerate(choices):
        logprobs[i] = await _start_logprobs(served, req, c)
    if req.echo:
        for i, c in enumerate(choices):
            lp = logprobs[i]
            yield chunk(c.index, c.prompt_text, None, None if lp is None else lp.body())
    sent = {i: len(lp.tokens) if lp else 0 for i, lp in logprobs.items()}
    async for i, out in run_choices(served, choices):
        tally.add(out)
        lp = logprobs[i]
        if lp is not None:
            lp.add_outputs(out.logprobs)
        if out.text or out.finish_reason or out.token_ids:
            body = None if lp is None else lp.body(sent[i])
            sent[i] = len(lp.tokens) if lp else 0
            if out.text or out.finish_reason or body:
                yield chunk(choices[i].index, out.text, out.finish_reason, body)
