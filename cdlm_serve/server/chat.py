"""POST /v1/chat/completions: messages through the tokenizer's chat template, then the same
engines and choice handling as completions, in the chat response shapes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from cdlm_serve.engine.decoding import EngineOutput, TokenLogprob
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.metrics import Metrics
from cdlm_serve.server.planning import (
    Choice,
    UsageCount,
    checked_prompt,
    gather,
    generation_options,
    new_id,
    plan_choices,
    reject_unsupported,
    run_choices,
)
from cdlm_serve.server.schemas import ChatCompletionRequest
from cdlm_serve.server.streaming import StreamHead, StreamKind


def render_prompt(served: ServedModel, req: ChatCompletionRequest) -> str:
    if not served.chat_template:
        raise APIError(
            400,
            f"model {served.name!r} has no chat template; use /v1/completions",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        prompt: str = served.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return prompt
    except Exception as e:  # a template that rejects the conversation (roles, order, ...)
        raise APIError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from None


def plan_chat(served: ServedModel, req: ChatCompletionRequest) -> list[Choice]:
    top = (req.top_logprobs or 0) if req.logprobs else None
    options = generation_options(req, req.max_completion_tokens or req.max_tokens, top)
    reject_unsupported(
        served,
        options,
        {
            "tools": bool(req.tools),
            "logprobs": served.is_diffusion and req.logprobs,
        },
    )
    text = render_prompt(served, req)
    # Taken as rendered: a chat template writes the BOS itself where its model wants one.
    ids = checked_prompt(served, text, "messages", start=False)
    return plan_choices(served, options, [(ids, text)])


def _logprob_entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _content_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            **_logprob_entry(tokenizer, lp.token, lp.logprob),
            "top_logprobs": [_logprob_entry(tokenizer, t, v) for t, v in lp.top],
        }
        for lp in logprobs
    ]


async def complete(
    served: ServedModel,
    req: ChatCompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> dict[str, Any]:
    logprobs: list[list[dict[str, Any]]] = [[] for _ in choices]

    def add_logprobs(i: int, out: EngineOutput) -> None:
        logprobs[i] += _content_logprobs(served.tokenizer, out.logprobs)

    answer = await gather(served, choices, req.n, metrics, add_logprobs)
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": answer.texts[i]},
                "logprobs": {"content": logprobs[i]} if req.logprobs else None,
                "finish_reason": answer.finish[i],
            }
            for i, c in enumerate(choices)
        ],
        "usage": answer.usage,
    }


async def _chunks(
    served: ServedModel,
    req: ChatCompletionRequest,
    choices: list[Choice],
    head: StreamHead,
    tally: UsageCount,
) -> AsyncIterator[str]:
    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> str:
        content = {"content": logprobs} if req.logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": content, "finish_reason": finish}
        return head.chunk(choice)

    for c in choices:  # the role comes first, as OpenAI sends it
        yield chunk(c.index, {"role": "assistant", "content": ""}, None, [])
    async for i, out in run_choices(served, choices):
        tally.add(out, i)
        lps = _content_logprobs(served.tokenizer, out.logprobs)
        if out.text or out.finish_reason or lps:
            delta = {"content": out.text} if out.text else {}
            yield chunk(choices[i].index, delta, out.finish_reason, lps)


STREAM = StreamKind("chat.completion.chunk", "chatcmpl", _chunks)  # for server.streaming.stream
