"""A request's `tools`, `tool_choice` and `parallel_tool_calls`, read once where they enter
(chat's and the Responses API's spellings alike) into what answering needs (`ToolUse`): the
functions to render into the prompt, the grammar that forces a call (`required`, a named
function), and the parser that reads calls back out of the answer (`auto`, and the forced
ones, whose text the grammar shaped). Bad input is a 400 naming the field: a tool that is not a
function, two tools of one name, parameters that are not an object's schema, a `tool_choice`
that names no tool or asks for a call without tools. A schema the grammar engine cannot compile
is a 400 too, when the forced call's grammar is compiled (`Engine.params`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from cdlm_serve.engine.decoding import GrammarSpec
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.tool_format import FunctionTool, ToolFormat, format_for
from cdlm_serve.server.tool_parser import ToolCallParser

MAX_TOOLS = 128  # OpenAI's limit on the tools of one request
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

Mode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request's tools ask of its answer."""

    tools: list[FunctionTool]
    mode: Mode  # "function": the one named by `forced` must be called
    forced: str | None
    parallel: bool
    fmt: ToolFormat

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def offered(self) -> list[FunctionTool]:
        """The tools the prompt shows the model (none with `tool_choice: "none"`, as vLLM
        does by default: a model that is not to call tools is not shown them)."""
        return [] if self.mode == "none" else self.tools

    def grammar(self) -> GrammarSpec | None:
        """The grammar of a forced call (one to the named function; one or more, or exactly
        one without `parallel`, to any tool where calls are `required`), or None."""
        if self.mode == "required":
            return self.fmt.grammar(self.tools, self.parallel, "tool_choice")
        if self.mode == "function":
            tool = next(t for t in self.tools if t.name == self.forced)
            return self.fmt.grammar([tool], False, "tool_choice")
        return None

    def parser(self) -> ToolCallParser | None:
        """A reader of one answer's calls, or None where no call can be made."""
        if self.mode == "none":
            return None
        return ToolCallParser(self.fmt, self.names, single=not self.parallel)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _function(raw: Any, where: str) -> FunctionTool:
    """One function tool from its fields (`name`, `description`, `parameters`)."""
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad("tools", f"{where}.name must be 1-64 letters, digits, '_' or '-'")
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad("tools", f"{where}.description must be a string")
    parameters = raw.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS  # OpenAI: a function without parameters takes none
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise _bad("tools", f"{where}.parameters must be the JSON schema of an object")
    return FunctionTool(name, description, parameters)


def chat_tools(tools: list[Any] | None) -> list[FunctionTool]:
    """Chat's tools: `{"type": "function", "function": {name, description, parameters}}`."""
    return _tools(tools, lambda t: t.get("function") if t.get("type") == "function" else None)


def response_tools(tools: list[Any] | None) -> list[FunctionTool]:
    """The Responses API's tools: `{"type": "function", name, description, parameters}`."""
    return _tools(tools, lambda t: t if t.get("type") == "function" else None)


def _tools(tools: list[Any] | None, fields: Any) -> list[FunctionTool]:
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools are allowed")
    out: list[FunctionTool] = []
    for i, raw in enumerate(tools):
        where = f"tools[{i}]"
        function = fields(raw) if isinstance(raw, dict) else None
        if not isinstance(function, dict):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind == "function":
                raise _bad("tools", f"{where}: a function tool needs its name and parameters")
            raise _bad("tools", f"{where} is {kind!r}: only function tools are supported")
        tool = _function(function, where)
        if any(t.name == tool.name for t in out):
            raise _bad("tools", f"{where}: two tools are named {tool.name!r}")
        out.append(tool)
    return out


def _named(choice: dict[str, Any]) -> str | None:
    """The function a named `tool_choice` forces: chat's `{"type": "function", "function":
    {"name": ...}}` or the Responses API's `{"type": "function", "name": ...}`."""
    if choice.get("type") != "function":
        return None
    inner = choice.get("function")
    name = inner.get("name") if isinstance(inner, dict) else choice.get("name")
    return name if isinstance(name, str) else None


def tool_use(
    served: ServedModel,
    tools: list[FunctionTool],
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> ToolUse | None:
    """What the request's tools ask of its answer, or None where it has none."""
    forced = None
    if isinstance(tool_choice, dict):
        forced = _named(tool_choice)
        if forced is None:
            raise _bad("tool_choice", "tool_choice must name a function: {'type': 'function', ...}")
        mode: Mode = "function"
    elif tool_choice in (None, "none", "auto", "required"):
        mode = tool_choice or "auto"  # type: ignore[assignment]
    else:
        raise _bad("tool_choice", "tool_choice must be none, auto, required or a named function")
    if not tools:
        if mode in ("required", "function"):
            raise _bad("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return None
    if forced is not None and forced not in {t.name for t in tools}:
        raise _bad("tool_choice", f"tool_choice names {forced!r}, which is not in tools")
    fmt = format_for(served.chat_template, served.config.family)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolUse(tools, mode, forced, parallel, fmt)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
