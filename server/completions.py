"""POST /v1/completions: turn a request into engine jobs, and their output into OpenAI's
response (one JSON body) or its server-sent-event stream."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.ar_engine import StepOutput
from engine.sampling import SamplingParams
from engine.served_model import ServedModel
from engine.worker import QueueFull
from server.errors import APIError, error_body
from server.schemas import CompletionRequest


@dataclass(slots=True)
class Choice:
    """One (prompt, sample) pair of a request: `n` choices per prompt, in OpenAI's order."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams


def _reject_unsupported(req: CompletionRequest) -> None:
    unsupported = {
        "logprobs": req.logprobs is not None,
        "suffix": req.suffix is not None,
        "best_of": req.best_of is not None and req.best_of != req.n,
        "presence_penalty": req.presence_penalty != 0.0,
        "frequency_penalty": req.frequency_penalty != 0.0,
    }
    for param, used in unsupported.items():
        if used:
            raise APIError(400, f"{param} is not supported by this server yet", param=param)


def _prompt_ids(served: ServedModel, req: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt of the request as (token ids, text)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        texts: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        texts = [prompt]  # type: ignore[list-item]
    else:
        texts = list(prompt)  # type: ignore[arg-type]
    vocab = served.config.vocab_size
    out = []
    for p in texts:
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


def plan_choices(served: ServedModel, req: CompletionRequest) -> list[Choice]:
    _reject_unsupported(req)
    prompts = _prompt_ids(served, req)
    limit = served.max_model_len
    choices = []
    for i, (ids, text) in enumerate(prompts):
        room = limit - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        if max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        for j in range(req.n):
            seed = None if req.seed is None else req.seed + j
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=seed,
                stop=list(req.stop or []),
            )
            choices.append(Choice(i * req.n + j, ids, text, params))
    return choices


def _job(served: ServedModel, choice: Choice):
    def run(aborted):
        return served.engine.generate(choice.prompt_ids, choice.params, aborted)

    return run


async def run_choice(served: ServedModel, choice: Choice) -> AsyncIterator[StepOutput]:
    try:
        async for out in served.worker.stream(_job(served, choice)):
            yield out
    except QueueFull as e:
        raise APIError(429, str(e), headers={"Retry-After": "1"}) from None


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


async def complete(served: ServedModel, req: CompletionRequest, choices: list[Choice]) -> dict:
    completion_tokens = 0
    out_choices = []
    for choice in choices:
        parts = [choice.prompt_text] if req.echo else []
        finish = None
        async for step in run_choice(served, choice):
            parts.append(step.text)
            completion_tokens += len(step.token_ids)
            finish = step.finish_reason or finish
        out_choices.append(
            {
                "index": choice.index,
                "text": "".join(parts),
                "logprobs": None,
                "finish_reason": finish,
            }
        )
    prompt_tokens = _prompt_tokens(choices, req.n)
    return {
        "id": new_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": out_choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _prompt_tokens(choices: list[Choice], n: int) -> int:
    # Each prompt counts once, however many samples were drawn from it (OpenAI's accounting).
    return sum(len(c.prompt_ids) for c in choices[::n])


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream(
    served: ServedModel, req: CompletionRequest, choices: list[Choice]
) -> AsyncIterator[str]:
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

    completion_tokens = 0
    try:
        for choice in choices:
            if req.echo:
                yield chunk(choice.index, choice.prompt_text, None)
            async for step in run_choice(served, choice):
                completion_tokens += len(step.token_ids)
                if step.text or step.finish_reason:
                    yield chunk(choice.index, step.text, step.finish_reason)
    except APIError as e:
        yield _sse(error_body(e.status, e.message, e.param, e.code))
    if include_usage:
        prompt_tokens = _prompt_tokens(choices, req.n)
        yield _sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": served.name,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )
    yield _sse("[DONE]")
