"""POST /v1/completions: a request's choices (`server/planning.py`) and their engine outputs as
OpenAI's response, one JSON body or a server-sent-event stream (`server/streaming.py`), with
logprobs in the legacy completions shape. AR models stream one chunk per token, diffusion
models one per completed block and report `usage.steps`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cdlm_serve.engine.decoding import EngineOutput, TokenLogprob
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server.metrics import Metrics
from cdlm_serve.server.planning import (
    Choice,
    UsageCount,
    gather,
    new_id,
    run_choices,
)
from cdlm_serve.server.schemas import CompletionRequest
from cdlm_serve.server.streaming import StreamHead, StreamKind


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

    def add_outputs(self, logprobs: list[TokenLogprob]) -> None:
        for lp in logprobs:
            self.add(lp.token, lp.logprob, lp.top)

    def add_prompt(self, prompt: list[int], scored: list[TokenLogprob]) -> None:
        """An echoed prompt's tokens: the first has no logprob (nothing predicts it), the
        others the engine's (`scored`, computed as the prompt was prefilled)."""
        self.add(prompt[0], None, None)
        for lp in scored:
            self.add(lp.token, lp.logprob, lp.top or None)

    def body(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


# ---- the two response forms -------------------------------------------------------------------
async def complete(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> dict[str, Any]:
    logprobs = {i: _logprobs(served, req) for i in range(len(choices))}

    def add_logprobs(i: int, out: EngineOutput) -> None:
        lp = logprobs[i]
        if lp is not None:
            if out.prompt_logprobs is not None:
                lp.add_prompt(choices[i].prompt_ids, out.prompt_logprobs)
            lp.add_outputs(out.logprobs)

    answer = await gather(served, choices, req.n, metrics, add_logprobs)
    return {
        "id": new_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": [
            {
                "index": c.index,
                "text": (c.prompt_text if req.echo else "") + answer.texts[i],
                "logprobs": None if (lp := logprobs[i]) is None else lp.body(),
                "finish_reason": answer.finish[i],
            }
            for i, c in enumerate(choices)
        ],
        "usage": answer.usage,
    }


def _logprobs(served: ServedModel, req: CompletionRequest) -> LegacyLogprobs | None:
    """A choice's logprobs, if the request asks for them (an echoed prompt's come with the
    choice's first output: the engine scores the prompt as it prefills it)."""
    return None if req.logprobs is None else LegacyLogprobs(served.tokenizer)


async def _chunks(
    served: ServedModel,
    req: CompletionRequest,
    choices: list[Choice],
    head: StreamHead,
    tally: UsageCount,
) -> AsyncIterator[str]:
    def chunk(
        index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return head.chunk(choice)

    logprobs = {i: _logprobs(served, req) for i in range(len(choices))}
    if req.echo and req.logprobs is None:  # the prompts' text first
        for c in choices:
            yield chunk(c.index, c.prompt_text, None)
    sent = dict.fromkeys(logprobs, 0)
    async for i, out in run_choices(served, choices):
        tally.add(out, i)
        lp = logprobs[i]
        if lp is not None and out.prompt_logprobs is not None:  # echoed with its logprobs
            lp.add_prompt(choices[i].prompt_ids, out.prompt_logprobs)
            yield chunk(choices[i].index, choices[i].prompt_text, None, lp.body())
            sent[i] = len(lp.tokens)
        if lp is not None:
            lp.add_outputs(out.logprobs)
        if out.text or out.finish_reason or out.token_ids:
            body = None if lp is None else lp.body(sent[i])
            sent[i] = len(lp.tokens) if lp else 0
            if out.text or out.finish_reason or body:
                yield chunk(choices[i].index, out.text, out.finish_reason, body)


STREAM = StreamKind("text_completion", "cmpl", _chunks)  # for server.streaming.stream
