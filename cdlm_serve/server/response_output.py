"""A Responses API answer's output items, built as its text arrives: one assistant message
for its text, and one `function_call` item per tool call read out of it
(`server/tool_parser.py`), in the order they appear. The stream announces each item when it
first appears (`Added`), so its events and the final response list the same items at the same
indices. Without tools the answer is its one message, there from the start.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from cdlm_serve.server.tool_calls import call_id
from cdlm_serve.server.tool_parser import ParsedCall, ToolCallParser


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(slots=True)
class OutputItem:
    """The answer's message (`call` None: its text so far) or one of its calls."""

    id: str
    call: ParsedCall | None = None
    call_id: str = ""
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def body(self, status: str) -> dict[str, Any]:
        """The item as OpenAI's response lists it (`status` "in_progress" while it streams)."""
        if self.call is not None:  # read whole: complete once it exists, but in its stream
            done = status != "in_progress"
            return {
                "id": self.id,
                "type": "function_call",
                "status": "completed" if done else status,
                "call_id": self.call_id,
                "name": self.call.name,
                "arguments": self.call.arguments if done else "",
            }
        return {
            "id": self.id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(self.text)],
        }


@dataclass(frozen=True, slots=True)
class Added:
    """What one piece of the answer did: a new item at `index` (`new`), or text added to the
    message (`text`)."""

    index: int
    item: OutputItem
    new: bool
    text: str | None = None


@dataclass(slots=True)
class Output:
    """The items of one answer; `parser` reads its calls (None: a request without tools)."""

    parser: ToolCallParser | None
    items: list[OutputItem] = field(default_factory=list)
    _message: int | None = None  # the message's index, once it exists

    def __post_init__(self) -> None:
        if self.parser is None:  # text only: the message is there from the start
            self._new_message()

    @property
    def message(self) -> OutputItem | None:
        return None if self._message is None else self.items[self._message]

    @property
    def calls(self) -> list[OutputItem]:
        return [item for item in self.items if item.call is not None]

    def _new_message(self) -> Added:
        self._message = len(self.items)
        self.items.append(OutputItem(item_id("msg")))
        return Added(self._message, self.items[-1], True)

    def take(self, text: str, final: bool) -> list[Added]:
        """The answer's next text (and, where `final`, its end): what it added, in order."""
        if self.parser is None:
            pieces: list[str | ParsedCall] = [text] if text else []
        else:
            pieces = self.parser.feed(text) + (self.parser.finish() if final else [])
        added: list[Added] = []
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                self.items.append(OutputItem(item_id("fc"), piece, call_id()))
                added.append(Added(len(self.items) - 1, self.items[-1], True))
                continue
            if self._message is None:
                added.append(self._new_message())
            index = len(self.items) - 1 if self._message is None else self._message
            self.items[index].parts.append(piece)
            added.append(Added(index, self.items[index], False, piece))
        if final and not self.items:  # an answer of nothing is one empty message
            added.append(self._new_message())
        return added

    def bodies(self, status: str) -> list[dict[str, Any]]:
        return [item.body(status) for item in self.items]
