"""How a model family writes its tool calls, and how a conversation with tools is put to it.

A `ToolFormat` is one family's written form: where a call starts and ends, how its name and
arguments sit in one JSON object, and what separates parallel calls. It serves the three
places that must agree on it: the prompt (the tools and earlier calls and results rendered
for the model, `render`), the grammar that forces a call (`tool_choice` `required` or a named
function: `grammar`), and the parser that reads calls back out of free text (`tool_parser`).

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
  call, results as `<tool_response>` blocks in a user turn (Hermes 2 Pro's form, which Qwen 2.5
  and 3 were trained on). It is also our documented system-prompt form, for the many chat
  templates that have no tools of their own (SmolLM2's and Gemma 3's among them): the tools go
  into the system message as `<tools>` JSON lines, with the instruction to call them this way.
- `llama3_json`: a bare `{"name": ..., "parameters": {...}}` object, calls separated by `; `
  (Llama 3.1-3.3's JSON tool calling). It is used only where the model's own template renders
  the tools (a Llama 3 template with `tools`).

A template that renders tools itself (its Jinja reads `tools`) gets them, the assistant's
earlier calls and the tool results in the OpenAI message form it expects; the family's format
then only parses and forces calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cdlm_serve.engine.decoding import JSON_OPTIONS, GrammarSpec

# The system-prompt form (Hermes'), for templates without tools of their own.
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function a request offers the model (OpenAI's `function` tool)."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of an object (an empty one where none is given)

    def openai(self) -> dict[str, Any]:
        """Chat's tool object, as templates and the system prompt show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's written form of a tool call (see the module's docstring)."""

    name: str
    start: str  # what opens a call ("" where a call is a bare JSON object)
    end: str  # what closes it
    separator: str  # between parallel calls
    arguments_key: str  # the JSON key of the arguments ("arguments", "parameters")
    prompt: str  # the system-prompt block that shows tools and asks for calls in this form

    def write_call(self, name: str, arguments: str) -> str:
        """One call as the model writes it (`arguments`: a JSON object's text)."""
        body = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}}}'
        return f"{self.start}{body}{self.end}"

    def write_calls(self, calls: list[tuple[str, str]]) -> str:
        return self.separator.join(self.write_call(n, a) for n, a in calls)

    def grammar(self, tools: list[FunctionTool], parallel: bool, param: str) -> GrammarSpec:
        """The grammar of an answer that is only calls to `tools` (one, or one or more where
        `parallel`), each call's arguments valid for its function's parameters: one rule per
        function, each its own JSON schema (so that each keeps its own `$defs`)."""
        call = " ".join(
            [*([json.dumps(self.start)] if self.start else []), "body"]
            + ([json.dumps(self.end)] if self.end else [])
        )
        lines = [
            f"start: call ({json.dumps(self.separator)} call)*" if parallel else "start: call",
            f"call: {call}",
            "body: " + " | ".join(f"f{i}" for i in range(len(tools))),
        ]
        lines += [f"f{i}: %json {json.dumps(self._call_schema(t))}" for i, t in enumerate(tools)]
        return GrammarSpec("lark", "\n".join(lines) + "\n", param)

    def _call_schema(self, tool: FunctionTool) -> dict[str, Any]:
        """The JSON schema of one call to `tool`. Its parameters' own definitions (`$defs`,
        `definitions`: pydantic writes a nested model's there) move to the root, where their
        `$ref`s point; the parameters themselves become one more definition."""
        arguments = _closed(tool.parameters)
        defs: dict[str, Any] = {
            k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments
        }
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                self.arguments_key: {"$ref": f"#/$defs/{ARGUMENTS}"},
            },
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
            **defs,
            "$defs": {**defs.get("$defs", {}), ARGUMENTS: arguments},
            # The JSON written as `json.dumps` writes it (no runs of whitespace to loop on).
            "x-guidance": JSON_OPTIONS,
        }


ARGUMENTS = "__call_arguments"  # the parameters' name among a call schema's definitions


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema as a forced call follows it: where it lists properties, none
    beyond them unless the schema allows them itself (what OpenAI's function calling does;
    JSON Schema's own default, any extra property, lets a small model copy the schema's
    keywords in). A schema without properties (any object) stays open."""
    if not parameters.get("properties"):
        return dict(parameters)
    return {"additionalProperties": False, **parameters}


# Llama 3.1-3.3's own words for its JSON calls (what its template writes before the tools).
LLAMA3_PROMPT = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}"
)
HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", TOOLS_PROMPT)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters", LLAMA3_PROMPT)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}
# The model families whose own templates render tools, and the form their models call in.
NATIVE_FORMATS = {"llama": LLAMA3_JSON, "qwen2": HERMES, "qwen3": HERMES}


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a request's tools itself (its Jinja reads `tools`)."""
    return chat_template is not None and "tools" in chat_template


def format_for(chat_template: str | None, family: str) -> ToolFormat:
    """The form a model calls tools in: where its template renders tools, the form the
    template writes calls in (`<tool_call>` blocks: hermes, whatever the family, as Hermes
    fine-tunes of Llama do), else its family's; without, the system-prompt form (hermes)."""
    if renders_tools(chat_template) and "<tool_call>" not in (chat_template or ""):
        return NATIVE_FORMATS.get(family, HERMES)
    return HERMES


def tools_prompt(tools: list[FunctionTool], fmt: ToolFormat = HERMES) -> str:
    """The system-prompt block that shows the model its tools and asks for calls in `fmt`
    (hermes: the system-prompt form's; a continuation of a model whose template renders
    tools in another form shows new tools in that form)."""
    lines = [json.dumps(t.openai()) for t in tools]
    return fmt.prompt.format(tools=("\n" if fmt is HERMES else "\n\n").join(lines))


def _tool_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive tool messages as the one user turn of `<tool_response>` blocks."""
    blocks = [f"<tool_response>\n{m.get('content') or ''}\n</tool_response>" for m in results]
    return {"role": "user", "content": "\n".join(blocks)}


def render(
    messages: list[dict[str, Any]], tools: list[FunctionTool], native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (OpenAI's form: an assistant's `tool_calls`, `role: "tool"` results) and
    the `tools` argument for `apply_chat_template`. A `native` template takes them as they are
    (arguments as objects, as HF templates expect); otherwise the tools go into the system
    message, calls into the assistant's text and results into user turns (`hermes`)."""
    if native:
        out = [_native(m) for m in messages]
        return out, [t.openai() for t in tools] or None
    rendered: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            results.append(m)
            continue
        message = _hermes_message(m)
        if results:
            turn = _tool_results(results)
            results = []
            if m["role"] == "user":
                # One user turn, not two in a row (which strict templates, Gemma 3's, refuse).
                message = {"role": "user", "content": f"{turn['content']}\n\n{message['content']}"}
            else:
                rendered.append(turn)
        rendered.append(message)
    if results:
        rendered.append(_tool_results(results))
    if tools:
        block = tools_prompt(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{block}"}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None


def _hermes_message(m: dict[str, Any]) -> dict[str, Any]:
    calls = m.get("tool_calls") or []
    if not calls:
        return {"role": m["role"], "content": m.get("content") or ""}
    functions = [c["function"] for c in calls]
    written = HERMES.write_calls([(f["name"], _json_object(f["arguments"])) for f in functions])
    content = m.get("content") or ""
    return {"role": m["role"], "content": f"{content}\n{written}" if content else written}


def _native(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if v is not None}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _as_object(c["function"]["arguments"]),
                },
            }
            for c in m["tool_calls"]
        ]
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # not JSON: as the client sent it


def _json_object(arguments: str) -> str:
    """A call's arguments, sent back by a client, as JSON text to write into the prompt: as
    sent where they are a JSON object (the model's own text, byte for byte), else an empty
    object for nothing, or the text as a JSON string (never text that breaks the call)."""
    if not arguments.strip():
        return "{}"
    value = _as_object(arguments)
    return arguments if isinstance(value, dict) else json.dumps(arguments)
