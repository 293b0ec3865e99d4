"""What a Responses API request's `input` and `instructions` become for a chat model.

A new conversation is its messages (instructions first, as a system message) rendered through
the model's chat template (`first_prompt`). A conversation that continues a stored response
feeds the model only what comes after that response's answer (`continuation_ids`): the end of
the assistant's turn, the new messages and the generation prompt, as the template renders them,
so the earlier turns are never prefilled again (their keys and values are in the stored
response's cache). Only text is taken: other content and item types answer a clear 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.planning import checked_prompt
from cdlm_serve.server.tool_format import (
    HERMES,
    FunctionTool,
    ToolFormat,
    format_for,
    render,
    renders_tools,
    tools_prompt,
)

# Message roles as the chat template knows them (OpenAI's "developer" is a system message).
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_ITEMS = 1024  # input items per request (the body's size bounds them too)


@dataclass(slots=True)
class Turn:
    """A request's new messages (chat's form: an assistant's `tool_calls`, `role: "tool"`
    results), instructions and the tools its prompt shows, and the stored response a
    compaction item in its input names (OpenAI's compacted state: the item `POST
    /v1/responses/compact` returned)."""

    messages: list[dict[str, Any]]
    instructions: str | None = None
    compacted: str | None = None
    tools: list[FunctionTool] = field(default_factory=list)

    def first(self) -> list[dict[str, Any]]:
        """A new conversation's messages: the instructions first, as a system message."""
        if self.instructions is None:
            return list(self.messages)
        return [{"role": "system", "content": self.instructions}, *self.messages]

    def after(
        self,
        stored_instructions: str | None,
        stored_tools: list[FunctionTool],
        fmt: ToolFormat = HERMES,
    ) -> list[dict[str, Any]]:
        """A continuation's new messages. The stored conversation's instructions and tools
        are in its cache already: the same again (OpenAI's clients send them with every
        turn, as OpenAI does not carry them over) are not repeated; other ones come as a
        system message before the new messages (new tools as `tool_format.tools_prompt`
        shows them in `fmt`, the form the model calls in, wherever the template would have
        put its own)."""
        system = []
        if self.instructions is not None and self.instructions != stored_instructions:
            system.append(self.instructions)
        if self.tools and self.tools != stored_tools:
            system.append(tools_prompt(self.tools, fmt))
        if not system:
            return list(self.messages)
        return [{"role": "system", "content": "\n\n".join(system)}, *self.messages]


def _refuse(message: str) -> APIError:
    return APIError(400, message, param="input")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _refuse(
                f"{where}.content[{j}] is {kind or 'not a text part'!r}: only text input "
                f"({', '.join(TEXT_PARTS)}) is supported"
            )
        texts.append(part["text"])
    return "".join(texts)


def parse_input(input_: str | list[Any] | None, instructions: str | None) -> Turn:
    """The request's messages (400 for anything but text messages and one leading
    compaction item)."""
    turn = Turn([], instructions)
    if isinstance(input_, str):
        turn.messages.append({"role": "user", "content": input_})
        return turn
    items = input_ or []
    if len(items) > MAX_ITEMS:
        raise _refuse(f"at most {MAX_ITEMS} input items are allowed")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "compaction":
            content = item.get("encrypted_content")
            if i != 0 or not isinstance(content, str):
                raise _refuse(f"{where}: a compaction item comes first, with its encrypted_content")
            turn.compacted = content
            continue
        if kind == "function_call":
            _add_call(turn.messages, _function_call(item, where))
            continue
        if kind == "function_call_output":
            turn.messages.append(_call_output(item, where))
            continue
        if kind != "message":
            raise _refuse(
                f"{where}: input items of type {kind!r} are not supported (messages, "
                "function_call, function_call_output)"
            )
        role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise _refuse(f"{where}.role must be one of {', '.join(ROLES)}")
        turn.messages.append({"role": role, "content": _text(item.get("content"), where)})
    return turn


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _refuse(f"{where}.{key} must be a string")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A call the model made earlier (the client sends the conversation back), in chat's
    form."""
    name, arguments = _string(item, "name", where), _string(item, "arguments", where)
    call_id = _string(item, "call_id", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """One call into the assistant's message it belongs to: the message just before it (its
    text, its other calls), or a new one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A call's result, as chat's `role: "tool"` message."""
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, where)
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text}


def _render(
    served: ServedModel, messages: list[dict[str, Any]], tools: list[FunctionTool] | None = None
) -> str:
    if not served.chat_template:
        raise APIError(400, f"model {served.name!r} has no chat template", param="model")
    try:
        messages, tools_arg = render(messages, tools or [], renders_tools(served.chat_template))
        text: str = served.tokenizer.apply_chat_template(
            messages, tools=tools_arg, add_generation_prompt=True, tokenize=False
        )
        return text
    except Exception as e:  # a template that rejects the conversation (roles, order, ...)
        raise _refuse(f"the chat template rejected the messages: {e}") from None


def first_prompt(served: ServedModel, turn: Turn) -> list[int]:
    """The prompt of a new conversation."""
    if not turn.messages:
        raise _refuse("input is empty")
    text = _render(served, turn.first(), turn.tools)
    return checked_prompt(served, text, "input", start=False)


def continuation_ids(
    served: ServedModel,
    turn: Turn,
    next_input: int | None,
    stored_instructions: str | None,
    stored_tools: list[FunctionTool],
) -> list[int]:
    """What follows a stored answer: the template renders a conversation whose assistant
    answer ends in a unique marker, followed by the new messages; what comes after the marker
    is the text to feed. `next_input` is the answer's last sampled token, which the model has
    not run yet and which the session feeds first; where it is an end-of-text token the
    template also writes there (the model stopped at the end of its turn), it is not fed
    twice. A token that only looks like the turn's end (a newline in a template without an
    end-of-turn token, an answer cut at max_output_tokens) is the answer's own: kept."""
    if not turn.messages:
        raise _refuse("input is empty: a continuation needs at least one message")
    marker = f"<<{uuid.uuid4().hex}>>"
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
    # The form new tools are shown in: the one the model calls in (none shown: no matter).
    fmt = format_for(served.chat_template, served.config.family) if turn.tools else HERMES
    text = _render(served, probe + turn.after(stored_instructions, stored_tools, fmt))
    _, found, after = text.partition(marker)
    if not found or marker in after:
        raise APIError(
            400,
            f"the chat template of {served.name!r} cannot continue a stored conversation",
            param="previous_response_id",
        )
    ids = checked_prompt(served, after, "input", start=False)
    if next_input in served.eos_token_ids and ids[:1] == [next_input]:
        ids = ids[1:]
    return ids


def prompt_text(served: ServedModel, turn: Turn) -> list[int]:
    """A whole conversation given as input, ending in an assistant's answer, as a stored
    response holds it: up to the end of that answer's text (where `continuation_ids` goes
    on)."""
    last = turn.messages[-1] if turn.messages else None
    if last is None or last["role"] != "assistant" or last.get("tool_calls"):
        raise _refuse("the conversation to compact must end with an assistant's text")
    marker = f"<<{uuid.uuid4().hex}>>"
    messages = turn.first()
    last = {**messages[-1], "content": messages[-1]["content"] + marker}
    before, found, _ = _render(served, [*messages[:-1], last], turn.tools).partition(marker)
    if not found:
        raise _refuse(f"the chat template of {served.name!r} drops the assistant's answer")
    # Stored whole as the new session's cache: it must leave the context room to go on.
    return checked_prompt(served, before, "input", start=False, stored="the conversation")


# The key under which a stored response's record keeps the input items it was created with
# (`GET /v1/responses/{id}/input_items`); never part of the response object itself.
INPUT_ITEMS = "input_items"


def input_items(input_: str | list[Any] | None) -> list[dict[str, Any]]:
    """A request's input (already checked by `parse_input`) as OpenAI lists it: message items
    with an id, a status and typed text parts; compaction, function call and call output
    items as given, with an id (and a status)."""
    if isinstance(input_, str):
        input_ = [{"type": "message", "role": "user", "content": input_}]
    out: list[dict[str, Any]] = []
    for item in input_ or []:
        kind = item.get("type", "message")
        if kind == "compaction":
            out.append({"id": _item_id(), "type": "compaction", **item})
            continue
        if kind in ("function_call", "function_call_output"):
            out.append({"id": _item_id(), "status": "completed", **item})
            continue
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = item.get("content")
        parts = content if isinstance(content, list) else [{"text": content}]
        out.append(
            {
                "id": _item_id(),
                "type": "message",
                "role": item.get("role"),
                "status": "completed",
                "content": [{"type": kind, "text": part.get("text", "")} for part in parts],
            }
        )
    return out


def _item_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def items_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """One page of a list of items, OpenAI's list object: `order` "desc" is newest first,
    `after` the id of the item the page follows (404 if no item has it)."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(404, f"no input item {after!r} in this response", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
