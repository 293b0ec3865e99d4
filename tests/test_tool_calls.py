"""Tool calls (issue 56 item 2): tools rendered into the prompt, calls forced by a grammar
(`tool_choice` "required" or a named function) or read out of free text ("auto") by the
family's parser, whole and streamed alike; `role: "tool"` results rendered back; the Responses
API's `function_call` items and `function_call_output` continuations; clear 400s."""

from __future__ import annotations

import json
import random
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

import tiny_models
from cdlm_serve.engine.decoding.grammar import Grammars
from cdlm_serve.server.response_input import Turn
from cdlm_serve.server.tool_format import HERMES, LLAMA3_JSON, FunctionTool, render
from cdlm_serve.server.tool_parser import ParsedCall, ToolCallParser, parse

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ZONE = {"type": "integer", "minimum": -12, "maximum": 14}
TIME = {"type": "object", "properties": {"zone": ZONE}, "required": ["zone"]}
TOOLS = [FunctionTool("get_weather", "The weather in a city", WEATHER),
         FunctionTool("get_time", None, TIME)]  # fmt: skip
NAMES = {t.name for t in TOOLS}


# ---- the parser -------------------------------------------------------------------------------
def _streamed(fmt, text: str, cuts: list[int]) -> list:
    parser, pieces, at = ToolCallParser(fmt, NAMES), [], 0
    for cut in [*cuts, len(text)]:
        pieces += parser.feed(text[at:cut])
        at = cut
    return pieces + parser.finish()


def _joined(pieces: list) -> tuple[str | None, list[ParsedCall]]:
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, ParsedCall)]


HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"zone": 2}}\n</tool_call>',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call> and <tool_call>{bad json',
    "no calls at all, just < and <tool and <tool_cal",
    '  <tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": 1}"}\n</tool_call>  ',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b", '
    '"unit": "celsius"}}</tool_call> then <tool_call>{"x": "</tool_call> <tool_call>',
]


def test_the_hermes_parser_reads_calls_and_keeps_the_rest_as_text():
    content, calls = parse(HERMES, NAMES, HERMES_TEXTS[0])
    assert content == "Let me check."
    assert calls == [ParsedCall("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                     ParsedCall("get_time", '{"zone": 2}')]  # fmt: skip
    # An unknown function and a call never closed stay text, as the model wrote them.
    content, calls = parse(HERMES, NAMES, HERMES_TEXTS[1])
    assert calls == [] and content == HERMES_TEXTS[1]
    assert parse(HERMES, NAMES, HERMES_TEXTS[2]) == (HERMES_TEXTS[2], [])
    # Arguments written as JSON text are read as the object they hold.
    assert parse(HERMES, NAMES, HERMES_TEXTS[3]) == (None, [ParsedCall("get_time", '{"zone": 1}')])
    # A closing tag inside an argument's string does not end the call; a call that is no JSON
    # at any closing tag ends at its first.
    content, calls = parse(HERMES, NAMES, HERMES_TEXTS[4])
    assert [json.loads(c.arguments)["city"] for c in calls] == ["a</tool_call>b"]
    assert content == 'then <tool_call>{"x": "</tool_call> <tool_call>'


def test_a_stream_cut_anywhere_reads_as_the_whole_answer():
    rng = random.Random(0)
    for text in HERMES_TEXTS:
        whole = parse(HERMES, NAMES, text)
        for cut in range(len(text) + 1):  # every single cut, then random many-cut streams
            assert _joined(_streamed(HERMES, text, [cut])) == whole, (text, cut)
        for _ in range(50):
            cuts = sorted(rng.sample(range(len(text)), k=min(len(text), rng.randint(1, 12))))
            assert _joined(_streamed(HERMES, text, cuts)) == whole
    # Text is sent as it comes, but never the start of a tag that may be a call.
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "get_time", "arguments": {"zone": 3}}</tool_call>') == [
        ParsedCall("get_time", '{"zone": 3}')
    ]


def test_without_parallel_calls_a_second_call_stays_text():
    one = HERMES.write_call("get_time", '{"zone": 1}')
    two = HERMES.write_call("get_time", '{"zone": 2}')
    parser = ToolCallParser(HERMES, NAMES, single=True)
    pieces = parser.feed(f"{one}\n{two}") + parser.finish()
    assert pieces == [ParsedCall("get_time", '{"zone": 1}'), two]
    parser = ToolCallParser(LLAMA3_JSON, NAMES, single=True)
    text = '{"name": "get_time", "parameters": {"zone": 1}}; {"name": "get_time"}'
    assert parser.feed(text) + parser.finish() == [
        ParsedCall("get_time", '{"zone": 1}'), '{"name": "get_time"}']  # fmt: skip
    # Nested past what the JSON parser takes: text, not an error.
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    assert parse(HERMES, NAMES, deep) == (deep, [])


def test_the_llama3_json_parser_reads_bare_calls():
    weather = '{"city": "Rome", "unit": "celsius"}'
    text = '{"name": "get_time", "parameters": {"zone": 1}}; ' + (
        f'{{"name": "get_weather", "parameters": {weather}}}'
    )
    content, calls = parse(LLAMA3_JSON, NAMES, text)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome", "unit": "celsius"}
    assert parse(LLAMA3_JSON, NAMES, "It is sunny.") == ("It is sunny.", [])
    assert parse(LLAMA3_JSON, NAMES, '{"name": "get_time"} and more') == (
        '{"name": "get_time"} and more',
        [],
    )
    for cut in range(len(text)):
        assert _joined(_streamed(LLAMA3_JSON, text, [cut])) == (content, calls)


# ---- the grammar of a forced call ------------------------------------------------------------
@pytest.fixture(scope="module")
def grammars(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return tokenizer, Grammars(tokenizer, len(tokenizer))


def _accepts(grammars, spec, text: str) -> bool:
    tokenizer, cache = grammars
    matcher = cache.matcher(spec)
    ids = tokenizer.encode(text)
    return (
        matcher.validate_tokens(ids) == len(ids)
        and matcher.consume_tokens(ids)
        and (matcher.is_accepting())
    )


def test_a_forced_calls_grammar_takes_only_valid_calls(grammars):
    one = HERMES.write_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    two = HERMES.write_call("get_time", '{"zone": 4}')
    required = HERMES.grammar(TOOLS, True, "tool_choice")
    assert _accepts(grammars, required, one)
    assert _accepts(grammars, required, f"{one}\n{two}")
    bad = [
        HERMES.write_call("get_weather", '{"city": "Oslo"}'),  # a required argument missing
        HERMES.write_call("get_weather", '{"city": "Oslo", "unit": "kelvin"}'),  # not in enum
        HERMES.write_call("get_weather", '{"city": "Oslo", "unit": "celsius", "x": 1}'),
        HERMES.write_call("get_time", '{"zone": "4"}'),  # a string, not an integer
        HERMES.write_call("get_date", '{"zone": 4}'),  # no such function
        "It is sunny.",
    ]
    for text in bad:
        assert not _accepts(grammars, required, text), text
    single = HERMES.grammar(TOOLS, False, "tool_choice")
    assert _accepts(grammars, single, one) and not _accepts(grammars, single, f"{one}\n{two}")

    # A nested model's schema keeps its $defs (pydantic writes them; their $refs resolve), and
    # parameters that list no properties take any object.
    class Place(BaseModel):
        city: str = Field(max_length=8)

    class Trip(BaseModel):
        to: Place
        days: int

    nested = [FunctionTool("plan", None, Trip.model_json_schema()),
              FunctionTool("log", None, {"type": "object"})]  # fmt: skip
    grammar = HERMES.grammar(nested, True, "tool_choice")
    assert _accepts(
        grammars, grammar, HERMES.write_call("plan", '{"to": {"city": "Rome"}, "days": 3}')
    )
    assert not _accepts(
        grammars, grammar, HERMES.write_call("plan", '{"to": {"town": "Rome"}, "days": 3}')
    )
    assert _accepts(grammars, grammar, HERMES.write_call("log", '{"a": [1, 2]}'))
    bare = LLAMA3_JSON.grammar(TOOLS[1:], False, "tool_choice")
    assert _accepts(grammars, bare, LLAMA3_JSON.write_call("get_time", '{"zone": 4}'))
    assert not _accepts(grammars, bare, one)


# ---- rendering --------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": 1}'}},
    ]},
    {"role": "tool", "tool_call_id": "a", "content": "3 C"},
    {"role": "tool", "tool_call_id": "b", "content": "14:00"},
]  # fmt: skip


def test_tools_calls_and_results_are_rendered_in_the_system_prompt_form():
    messages, tools_arg = render(CONVERSATION, TOOLS, native=False)
    assert tools_arg is None and [m["role"] for m in messages] == [
        "system", "user", "assistant", "user"]  # fmt: skip
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in system
    assert messages[2]["content"] == HERMES.write_calls(
        [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("get_time", '{"zone": 1}')]
    )
    # Both results in one user turn, in order.
    assert messages[3]["content"] == (
        "<tool_response>\n3 C\n</tool_response>\n<tool_response>\n14:00\n</tool_response>"
    )
    # A template that renders tools itself gets them, and the calls' arguments as objects.
    messages, tools_arg = render(CONVERSATION, TOOLS, native=True)
    assert [t["function"]["name"] for t in tools_arg] == ["get_weather", "get_time"]
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"zone": 1}
    assert messages[3] == {"role": "tool", "tool_call_id": "a", "content": "3 C"}
    # The user's next message joins the results' turn: roles still alternate (Gemma 3's
    # template refuses two user turns in a row; test_gemma3_270m renders it through that).
    going_on = [*CONVERSATION, {"role": "user", "content": "And tomorrow?"}]
    messages, _ = render(going_on, TOOLS, native=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[3]["content"].endswith("14:00\n</tool_response>\n\nAnd tomorrow?")


def test_new_tools_in_a_continuation_are_shown_in_the_form_the_model_calls_in():
    turn = Turn([{"role": "user", "content": "x"}], tools=TOOLS)
    assert turn.after(None, TOOLS) == turn.messages  # the stored ones: in the cache already
    (hermes, _) = turn.after(None, TOOLS[:1])
    assert hermes["role"] == "system" and "<tool_call>" in hermes["content"]
    (llama, _) = turn.after(None, TOOLS[:1], LLAMA3_JSON)
    assert "<tool_call>" not in llama["content"] and '"parameters": dictionary' in llama["content"]
    assert llama["content"].endswith(json.dumps(TOOLS[1].openai()))
    # What that form's parser reads is what the prompt asked for.
    asked = LLAMA3_JSON.write_call("get_time", '{"zone": 1}')
    assert parse(LLAMA3_JSON, NAMES, asked) == (None, [ParsedCall("get_time", '{"zone": 1}')])


# ---- over HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tiny_ar_and_dlm_server):
    return tiny_ar_and_dlm_server


CHAT_TOOLS = [t.openai() for t in TOOLS]


def _chat(base: str, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS,
            "max_tokens": 120, **body}  # fmt: skip
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def _events(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line.split(": ", 1)[1]) for line in r.iter_lines()
                if line.startswith("data: {")]  # fmt: skip


def _valid(call: dict) -> None:
    """A call's arguments follow its function's parameters (the schemas above)."""
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
    else:
        assert call["function"]["name"] == "get_time"
        assert set(args) == {"zone"} and -12 <= args["zone"] <= 14


def test_required_and_named_calls_are_forced_and_valid(base):
    ended = []
    for temperature, n in ((0.0, 1), (1.0, 3)):
        r = _chat(base, tool_choice="required", temperature=temperature, n=n, seed=1,
                  max_tokens=300)  # fmt: skip
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            message = choice["message"]
            assert message["tool_calls"], choice  # the first call fits the budget
            for call in message["tool_calls"]:
                assert call["type"] == "function" and call["id"].startswith("call_")
                _valid(call)
            ended.append(choice["finish_reason"])
            if choice["finish_reason"] == "tool_calls":
                assert message["content"] is None
            else:  # parallel calls up to the budget: the one cut off stays text
                assert choice["finish_reason"] == "length" and message["content"]
        named = {"type": "function", "function": {"name": "get_time"}}
        r = _chat(base, tool_choice=named, temperature=temperature, n=n, seed=2)
        for choice in r.json()["choices"]:
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_time"
            assert choice["finish_reason"] == "stop"  # a named call ends "stop", as OpenAI's
            _valid(call)
    assert "tool_calls" in ended, ended
    # Seeded, and room for the call: unseeded, a sampled call sometimes ran past 120 tokens
    # (its text then cut, "length", no call), one CI run in many.
    r = _chat(base, tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0,
              seed=3, max_tokens=300)  # fmt: skip
    for choice in r.json()["choices"]:
        assert len(choice["message"]["tool_calls"]) == 1, choice
        assert choice["finish_reason"] == "tool_calls"


def test_a_streamed_call_is_the_whole_answers_call(base):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS,
            "max_tokens": 120, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "seed": 5}  # fmt: skip
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
    events = _events(base, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    streamed = [c for d in deltas for c in d.get("tool_calls") or []]
    (expected,) = whole["choices"][0]["message"]["tool_calls"]
    assert len(streamed) == 1 and streamed[0]["index"] == 0
    assert streamed[0]["function"] == expected["function"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)


def test_auto_reads_a_call_out_of_the_answers_text(base):
    """`auto` parses what the model wrote: here a text shaped by a regex into a sentence and
    a call (the tiny model writes no calls of its own), whole and streamed alike."""
    regex = (
        r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": [1-9]\}\}\n</tool_call>'
    )
    r = _chat(base, guided_regex=regex, temperature=1.0, seed=3)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Sure." and choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    _valid(call)
    events = _events(base, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS,
        "max_tokens": 120, "guided_regex": regex, "temperature": 1.0, "seed": 3})  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    streamed = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"] for c in streamed] == [call["function"]]
    # tool_choice "none": the text is the answer, calls and all.
    r = _chat(base, guided_regex=regex, tool_choice="none", temperature=1.0, seed=3)
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"].startswith("Sure.\n<tool_call>")


class GetWeather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]


def test_the_sdk_parses_a_forced_calls_arguments_into_the_model(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    done = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0.0,
    )
    (call,) = done.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_tool_result_goes_back_to_the_model(base):
    """The round trip on chat: the forced call, then its result as a `tool` message, then an
    answer in text; the prompt is the call and the result as the system-prompt form writes
    them (the tiny model's byte tokens: one per character, counted)."""
    first = _chat(base, tool_choice="required", parallel_tool_calls=False, temperature=0.0)
    message = first.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    messages = [{"role": "user", "content": "x"}, message,
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]  # fmt: skip
    second = _chat(base, messages=messages, tool_choice="none", max_tokens=8, temperature=0.0)
    assert second.status_code == 200, second.text
    answer = second.json()
    assert "tool_calls" not in answer["choices"][0]["message"]
    written = HERMES.write_call(call["function"]["name"], call["function"]["arguments"])
    result = "<tool_response>\nsunny\n</tool_response>"
    rendered = [{"role": "user", "content": "x"}, {"role": "assistant", "content": written},
                {"role": "user", "content": result}]  # fmt: skip
    prompt = tiny_models.byte_tokenizer().apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=False
    )
    assert answer["usage"]["prompt_tokens"] == len(prompt.encode())


def test_bad_tools_are_400s(base):
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [CHAT_TOOLS[0], CHAT_TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f\n"}}]}, "tools"),
        ({"tools": [{"type": "function",
                     "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
          "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ]  # fmt: skip
    for extra, param in bad:
        r = _chat(base, **extra)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    r = _chat(base, model="dream")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    # A call sent back with arguments nested past the JSON parser's depth, or not JSON at
    # all: rendered as a JSON string, answered.
    for arguments in ("[" * 2000, "not json", ""):
        call = {"id": "c", "type": "function",
                "function": {"name": "get_time", "arguments": arguments}}  # fmt: skip
        messages = [{"role": "user", "content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c", "content": "1"}]  # fmt: skip
        r = _chat(base, messages=messages, max_tokens=2, tool_choice="none")
        assert r.status_code == 200, r.text


# ---- the Responses API ------------------------------------------------------------------------
RESPONSE_TOOLS = [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters} for t in TOOLS]  # fmt: skip


def test_responses_function_calls_continue_from_the_stored_conversation(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    kw = dict(model="tiny", tools=RESPONSE_TOOLS, max_output_tokens=40, temperature=0.0)
    first = client.responses.create(input="x", tool_choice="required", parallel_tool_calls=False,
                                    **{**kw, "max_output_tokens": 160})  # fmt: skip
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    _valid({"function": {"name": call.name, "arguments": call.arguments}})
    stored = client.responses.retrieve(first.id)
    assert stored.output[0].call_id == call.call_id and stored.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(input=[result], previous_response_id=first.id, **kw)
    assert second.status in ("completed", "incomplete")
    assert [o.type for o in second.output] == ["message"]
    # The whole conversation sent back as items starts a new one that answers the same (the
    # same prompt: the stored one showed the tools, and this one does).
    items = [{"role": "user", "content": "x"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments}, result]  # fmt: skip
    again = client.responses.create(input=items, **kw)
    assert again.output_text == second.output_text
    listed = client.responses.input_items.list(again.id, order="asc").data
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output"]


def test_a_streamed_responses_call_lists_the_items_it_announced(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    with client.responses.stream(model="tiny", input="x", tools=RESPONSE_TOOLS,
                                 tool_choice={"type": "function", "name": "get_time"},
                                 max_output_tokens=120, temperature=1.0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["function_call"] and final.output[
        0
    ].name == "get_time"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == final.output[0].arguments
    bad = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "x",
                     "tools": [{"type": "file_search"}]}, timeout=60)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_the_structured_and_tools_example_runs(base):
    """examples/structured_and_tools.py (docs/api.md's examples), as a user runs it."""
    import re

    from test_examples import run_example

    out = run_example(base, "structured_and_tools.py", "--model", "tiny")
    assert "chat call: get_weather(GetWeather(city=" in out
    assert "chat finish_reason: stop" in out  # a named function's call, as OpenAI ends it
    assert "responses call: get_weather({" in out and "structured: Forecast(city=" in out
    assert "structured (responses): Forecast(city=" in out
    assert re.search(r"json_object \((stop|length)\): \{", out), out
    assert re.search(r"guided_regex: 20[0-9]{2}-[01][0-9]-[0-3][0-9]\n", out), out
    assert re.search(r"guided_choice: (yes|no)\n", out), out
    assert re.search(r"sampling options: (stop|length) [0-9]+\n", out), out
