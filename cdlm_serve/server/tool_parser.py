"""Tool calls read back out of a model's answer, whole or as it streams (`tool_choice`
`auto`, and the forced forms, whose text the grammar has already shaped).

`ToolCallParser` takes the answer's text in pieces and gives back, in order, the text meant
for the user and each complete call. A streamed answer sends what it gives as it comes; a
whole answer is the same pieces joined (`parse`), so the two always agree. Text that only
might open a call is held until it is known; a call whose JSON does not parse, or names no
offered function, stays text, as vLLM's parsers leave it (a call's text that is not JSON at its
first closing tag is held, streamed, until the answer shows where it ends). The content is
trimmed: leading
whitespace is dropped and trailing whitespace is held until more text follows it, so the
newline between two calls is never sent as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cdlm_serve.server.tool_format import ToolFormat


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from the answer: its function and its arguments (a JSON object's text)."""

    name: str
    arguments: str


Piece = str | ParsedCall  # text for the user, or a call


class ToolCallParser:
    """The calls and text of one answer, read as its text arrives (`feed`, then `finish`)."""

    def __init__(self, fmt: ToolFormat, names: set[str], single: bool = False):
        self.fmt = fmt
        self.names = names
        self.single = single  # `parallel_tool_calls` false: a call after the first is text
        self._calls = 0
        self._open, self._close = fmt.start.strip(), fmt.end.strip()
        self._buffer = ""
        self._inside = False  # in a call's body (after its opening tag)
        self._bare: bool | None = None  # bare-JSON formats: whether the answer is calls
        self._started = False  # content sent yet (leading whitespace is dropped)
        self._held = ""  # trailing whitespace of the content, sent when more text follows

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._trim(self._drain(final=False))

    def finish(self) -> list[Piece]:
        pieces = self._trim(self._drain(final=True))
        self._held = ""  # the content's trailing whitespace is dropped
        return pieces

    # ---- reading ----------------------------------------------------------------------------
    def _drain(self, final: bool) -> list[Piece]:
        if not self._open:
            return self._drain_bare(final)
        out: list[Piece] = []
        while True:
            if not self._inside:
                at = self._buffer.find(self._open)
                if at >= 0:
                    out.append(self._buffer[:at])
                    self._buffer = self._buffer[at + len(self._open) :]
                    self._inside = True
                    continue
                keep = 0 if final else _partial_suffix(self._buffer, self._open)
                out.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            end = self._body_end(final)
            if end is None:
                if final:  # a call never closed (the answer was cut): its text as it is
                    out.append(self._open + self._buffer)
                    self._buffer, self._inside = "", False
                return out
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(self._close) :]
            self._inside = False
            call = self._call(body)
            out.append(call if call is not None else self._open + body + self._close)

    def _body_end(self, final: bool) -> int | None:
        """Where the call's body ends: at the first closing tag before which it is JSON (a
        string in its arguments may hold the tag itself), else, once the answer is whole, at
        the first closing tag; None while that is not known yet (or there is none)."""
        first = at = self._buffer.find(self._close)
        while at >= 0:
            if _is_json(self._buffer[:at]):
                return at
            at = self._buffer.find(self._close, at + 1)
        return first if final and first >= 0 else None

    def _drain_bare(self, final: bool) -> list[Piece]:
        """A format whose calls are bare JSON objects: an answer that starts with `{` is held
        whole, then read as calls (or given back as text where it is not only calls)."""
        if self._bare is None and self._buffer.strip():
            self._bare = self._buffer.lstrip().startswith("{")
        if not self._bare:
            out, self._buffer = self._buffer, ""
            return [out]
        if not final:
            return []
        text, self._buffer = self._buffer, ""
        pieces = self._bare_calls(text)
        return pieces if pieces is not None else [text]

    def _bare_calls(self, text: str) -> list[Piece] | None:
        """The calls the text is made of (with `single`, the first, and the rest as text), or
        None where it is not only calls."""
        decoder, calls, at = json.JSONDecoder(), list[Piece](), 0
        separator = self.fmt.separator.strip()
        while True:
            at = _skip(text, at, " \n\t")
            if at >= len(text):
                return calls or None
            if self.single and calls:
                return [*calls, text[at:]]
            try:
                obj, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            call = self._read(obj)
            if call is None:
                return None
            calls.append(call)
            at = _skip(text, at, " \n\t")
            if separator and text.startswith(separator, at):
                at += len(separator)

    def _call(self, body: str) -> ParsedCall | None:
        try:
            return self._read(json.loads(body))
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return None

    def _read(self, obj: Any) -> ParsedCall | None:
        """A call from its JSON object, or None where it names no offered function or its
        arguments are not an object."""
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get(self.fmt.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict) or (self.single and self._calls):
            return None
        self._calls += 1
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))

    # ---- trimming the content ---------------------------------------------------------------
    def _trim(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                out.append(piece)
                continue
            text = self._held + piece
            if not self._started:
                text = text.lstrip()
            body = text.rstrip()
            self._held = text[len(body) :]
            if body:
                self._started = True
                if out and isinstance(out[-1], str):
                    out[-1] += body
                else:
                    out.append(body)
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be a tag arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def parse(fmt: ToolFormat, names: set[str], text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's content (None where it is only calls) and its calls."""
    parser = ToolCallParser(fmt, names)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, ParsedCall)]
