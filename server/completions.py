"""POST /v1/completions: turn a request into engine work, and its output into OpenAI's
response (one JSON body) or its server-sent-event stream.

AR models run through the AR engine (one chunk per token when streaming); diffusion models
through the DLM engine (one chunk per completed block), whose responses also report
`usage.steps`, the forward passes the request took.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.dlm_engine import DLMParams
from engine.sampling import SamplingParams
from engine.scheduler import QueueFull
from engine.served_model import ServedModel
from server.errors import APIError, error_body
from server.metrics import Metrics
from server.schemas import CompletionRequest


@dataclass(slots=True)
class Choice:
    """One (prompt, sample) pair of a request: `n` choices per prompt, in OpenAI's order."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams | DLMParams


@dataclass(slots=True)
class Tally:
    """What a request produced, for usage and metrics."""

    completion_tokens: int = 0
    steps: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, out: Any) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.finish_reason is not None:
            self.reasons.append(out.finish_reason)
            self.steps += getattr(out, "steps", 0)


def _reject_unsupported(served: ServedModel, req: CompletionRequest) -> None:
    unsupported = {
        "logprobs": req.logprobs is not None,
        "suffix": req.suffix is not None,
        "best_of": req.best_of is not None and req.best_of != req.n,
        "presence_penalty": req.presence_penalty != 0.0,
        "frequency_penalty": req.frequency_penalty != 0.0,
    }
    if not served.is_diffusion:
        unsupported |= {
            "decoding": req.decoding is not None,
            "block_size": req.block_size is not None,
            "threshold": req.threshold is not None,
        }
    for param, used in unsupported.items():
        if used:
            what = (
                "by this server yet"
                if param not in ("decoding", "block_size", "threshold")
                else "for autoregressive models (it is a diffusion-model option)"
            )
            raise APIError(400, f"{param} is not supported {what}", param=param)


def _prompt_ids(served: ServedModel, req: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt of the request as (token ids, text)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    vocab = served.config.vocab_size
    out = []
    for p in items:
        if isinstance(p, str):
            ids = served.encode(p)
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


def _params(served: ServedModel, req: CompletionRequest, max_tokens: int, seed: int | None):
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    stop = list(req.stop or [])
    if not served.is_diffusion:
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
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
    )


def plan_choices(served: ServedModel, req: CompletionRequest) -> list[Choice]:
    _reject_unsupported(served, req)
    prompts = _prompt_ids(served, req)
    limit = served.max_model_len
    choices = []
    for i, (ids, text) in enumerate(prompts):
        room = limit - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise _context_error(limit, len(ids), max_tokens)
        for j in range(req.n):
            seed = None if req.seed is None else req.seed + j
            params = _params(served, req, max_tokens, seed)
            if isinstance(params, DLMParams):
                # The engine decodes whole blocks: the rounded-up budget must fit too.
                budget = math.ceil(max_tokens / params.block_size) * params.block_size
                if budget > room:
                    raise _context_error(
                        limit, len(ids), budget, ", max_tokens rounded up to whole blocks"
                    )
            choices.append(Choice(i * req.n + j, ids, text, params))
    return choices


async def run_choice(served: ServedModel, choice: Choice) -> AsyncIterator[Any]:
    """The engine outputs of one choice, in order; the last carries the finish reason."""

    def build(request_id, aborted):
        return served.engine.new_sequence(request_id, choice.prompt_ids, choice.params, aborted)

    try:
        async for out in served.worker.stream(build):
            yield out
    except QueueFull as e:
        raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
    except ValueError as e:  # the engine refused the request (limits it checks itself)
        raise APIError(400, str(e)) from None


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _usage(served: ServedModel, choices: list[Choice], n: int, tally: Tally) -> dict:
    # Each prompt counts once, however many samples were drawn from it (OpenAI's accounting).
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[::n])
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tally.completion_tokens,
        "total_tokens": prompt_tokens + tally.completion_tokens,
    }
    if served.is_diffusion:
        usage["steps"] = tally.steps
    return usage


def _record(
    metrics: Metrics | None, served: ServedModel, usage: dict, tally: Tally, started: float
) -> None:
    if metrics is None:
        return
    reason = "abort" if not tally.reasons else tally.reasons[-1]
    metrics.observe_request(
        served.name,
        usage["prompt_tokens"],
        usage["completion_tokens"],
        reason,
        time.perf_counter() - started,
    )


async def complete(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> dict:
    started = time.perf_counter()
    tally = Tally()
    out_choices = []
    for choice in choices:
        parts = [choice.prompt_text] if req.echo else []
        finish = None
        async for out in run_choice(served, choice):
            parts.append(out.text)
            tally.add(out)
            finish = out.finish_reason or finish
        out_choices.append(
            {
                "index": choice.index,
                "text": "".join(parts),
                "logprobs": None,
                "finish_reason": finish,
            }
        )
    usage = _usage(served, choices, req.n, tally)
    _record(metrics, served, usage, tally, started)
    return {
        "id": new_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": out_choices,
        "usage": usage,
    }


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> AsyncIterator[str]:
    started = time.perf_counter()
    cid, created = new_id(), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(index: int, text: str, finish: str | None) -> str:
        body = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": served.name,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            body["usage"] = None
        return _sse(body)

    tally = Tally()
    try:
        for choice in choices:
            if req.echo:
                yield chunk(choice.index, choice.prompt_text, None)
            async for out in run_choice(served, choice):
                tally.add(out)
                if out.text or out.finish_reason:
                    yield chunk(choice.index, out.text, out.finish_reason)
    except APIError as e:
        yield _sse(error_body(e.status, e.message, e.param, e.code))
    usage = _usage(served, choices, req.n, tally)
    _record(metrics, served, usage, tally, started)
    if include_usage:
        yield _sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": served.name,
                "choices": [],
                "usage": usage,
            }
        )
    yield _sse("[DONE]")
