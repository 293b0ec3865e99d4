"""POST /v1/chat/completions: messages (and tools, `server/tool_calls.py`) through the
tokenizer's chat template, then the same engines and choice handling as completions, in the
chat response shapes; an answer's tool calls read out of its text (`server/tool_parser.py`),
whole or as it streams."""

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
    forcing,
    gather,
    generation_options,
    new_id,
    plan_choices,
    reject_unsupported,
    run_choices,
)
from cdlm_serve.server.schemas import ChatCompletionRequest
from cdlm_serve.server.streaming import StreamHead, StreamKind
from cdlm_serve.server.tool_calls import ToolUse, call_id, chat_tools, tool_use
from cdlm_serve.server.tool_format import render, renders_tools
from cdlm_serve.server.tool_parser import ParsedCall, Piece, ToolCallParser, parse


def tools_of(served: ServedModel, req: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools, read (and checked) once per use; None without tools."""
    return tool_use(served, chat_tools(req.tools), req.tool_choice, req.parallel_tool_calls)


def render_prompt(served: ServedModel, req: ChatCompletionRequest, tools: ToolUse | None) -> str:
    if not served.chat_template:
        raise APIError(
            400,
            f"model {served.name!r} has no chat template; use /v1/completions",
            param="messages",
        )
    offered = tools.offered if tools is not None else []
    try:
        messages, tools_arg = render(
            [m.rendered() for m in req.messages], offered, renders_tools(served.chat_template)
        )
        prompt: str = served.tokenizer.apply_chat_template(
            messages, tools=tools_arg, add_generation_prompt=True, tokenize=False
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
            "tools": served.is_diffusion and bool(req.tools),
            "logprobs": served.is_diffusion and req.logprobs,
        },
    )
    tools = tools_of(served, req)
    options = forcing(options, tools.grammar() if tools is not None else None)
    text = render_prompt(served, req, tools)
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


def _wire_call(call: ParsedCall) -> dict[str, Any]:
    """A call as chat's `tool_calls` lists it (a stream's delta adds its `index`)."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call_id(), "type": "function", "function": function}


def _message(text: str, tools: ToolUse | None) -> dict[str, Any]:
    parser = tools.parser() if tools is not None else None
    if parser is None:
        return {"role": "assistant", "content": text}
    content, calls = parse(parser.fmt, parser.names, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [_wire_call(c) for c in calls]
    return message


def _finish(reason: str | None, called: bool, tools: ToolUse | None) -> str | None:
    """An answer that ended on its own after calling tools ends `tool_calls`, but for a call
    to the function `tool_choice` named, which ends `stop` (as OpenAI's and vLLM's do)."""
    named = tools is not None and tools.mode == "function"
    return "tool_calls" if called and reason == "stop" and not named else reason


async def complete(
    served: ServedModel,
    req: ChatCompletionRequest,
    choices: list[Choice],
    metrics: Metrics | None = None,
) -> dict[str, Any]:
    tools = tools_of(served, req)
    logprobs: list[list[dict[str, Any]]] = [[] for _ in choices]

    def add_logprobs(i: int, out: EngineOutput) -> None:
        logprobs[i] += _content_logprobs(served.tokenizer, out.logprobs)

    answer = await gather(served, choices, req.n, metrics, add_logprobs)
    messages = [_message(text, tools) for text in answer.texts]
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": [
            {
                "index": c.index,
                "message": messages[i],
                "logprobs": {"content": logprobs[i]} if req.logprobs else None,
                "finish_reason": _finish(answer.finish[i], "tool_calls" in messages[i], tools),
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

    tools = tools_of(served, req)
    parsers = [tools.parser() if tools is not None else None for _ in choices]
    called = [0] * len(choices)  # calls sent per choice (each call's index)
    for c in choices:  # the role comes first, as OpenAI sends it
        yield chunk(c.index, {"role": "assistant", "content": ""}, None, [])
    async for i, out in run_choices(served, choices):
        tally.add(out, i)
        lps = _content_logprobs(served.tokenizer, out.logprobs)
        deltas: list[dict[str, Any]] = []
        for piece in _pieces(parsers[i], out):
            if isinstance(piece, str):
                deltas.append({"content": piece})
            else:
                deltas.append({"tool_calls": [{"index": called[i], **_wire_call(piece)}]})
                called[i] += 1
        if not deltas and (out.finish_reason or lps):
            deltas = [{}]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            finish = _finish(out.finish_reason, called[i] > 0, tools) if last else None
            yield chunk(choices[i].index, delta, finish, lps if k == 0 else [])


def _pieces(parser: ToolCallParser | None, out: EngineOutput) -> list[Piece]:
    """An output's text as the stream sends it: as it is, or its content and calls."""
    if parser is None:
        return [out.text] if out.text else []
    return parser.feed(out.text) + (parser.finish() if out.finish_reason else [])


STREAM = StreamKind("chat.completion.chunk", "chatcmpl", _chunks)  # for server.streaming.stream
