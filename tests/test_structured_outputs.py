"""Structured outputs (issue 56 item 1): a JSON schema, any JSON object, a regex, a choice or a
grammar constrains an AR answer token by token (llguidance), greedy and sampled, streamed and
not, through every spelling clients send; a row without a grammar pays nothing and is
unchanged beside one with it. Diffusion models: tests/test_dlm_structured.py."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from cdlm_serve.engine.decoding import GenerationOptions, GrammarSpec, SamplingParams
from cdlm_serve.engine.limits import LimitError
from conftest import json_schema_spellings

PROMPT = list(b"Order: ")


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict asks

    name: str = Field(max_length=6)
    qty: int = Field(ge=0, le=99)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["pickup", "delivery"]
    items: list[Item] = Field(min_length=1, max_length=3)
    urgent: bool


ORDER = GrammarSpec("json_schema", json.dumps(Order.model_json_schema()))


@pytest.fixture(scope="module")
def engine(tiny_ar_engine):
    return tiny_ar_engine


def _answers(engine, grammar: GrammarSpec, n: int, seed: int = 0, **kw) -> list[tuple[str, str]]:
    """n answers decoded together (seeds seed.. seed + n - 1): (text, finish reason) each."""
    for i in range(n):
        options = GenerationOptions(grammar=grammar, **kw)
        params = engine.params(options, 300, seed + i)
        engine.add(engine.new_sequence(f"r{i}", PROMPT, params))
    texts = {f"r{i}": "" for i in range(n)}
    finish: dict[str, str] = {}
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id] += out.text
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
    return [(texts[f"r{i}"], finish[f"r{i}"]) for i in range(n)]


def test_sampled_answers_under_a_nested_schema_all_validate(engine):
    """100 answers at temperature 1 (objects, an array of objects, an enum, bounded strings
    and integers, required fields), decoded 10 at a time (8 rows, 2 waiting): every one
    parses and validates, and ends with "stop"; the schema is compiled once."""
    compiled = engine.grammars.compiled
    answers = []
    for batch in range(100 // 10):
        answers += _answers(engine, ORDER, 10, seed=10 * batch, temperature=1.0)
    for text, finish in answers:
        assert finish == "stop", (text, finish)
        Order.model_validate_json(text)
    assert len({t for t, _ in answers}) > 50  # sampled: not one answer a hundred times
    assert engine.grammars.compiled == compiled + 1


def test_regex_choice_json_object_and_grammar(engine):
    for temperature in (0.0, 1.0):
        for text, finish in _answers(engine, GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"), 3,
                                     temperature=temperature):  # fmt: skip
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) and finish == "stop", text
        choices = ["yes", "no", "maybe not"]
        spec = GrammarSpec("choice", json.dumps(choices))
        for text, _ in _answers(engine, spec, 3, temperature=temperature):
            assert text in choices
        lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
        for text, _ in _answers(engine, GrammarSpec("grammar", lark), 3, temperature=temperature):
            assert re.fullmatch(r"\(([1-9][0-9]?)(\+[1-9][0-9]?)*\)", text), text
    gbnf = 'root ::= "ab" [0-9] [0-9]'
    ((text, _),) = _answers(engine, GrammarSpec("grammar", gbnf), 1, temperature=0.0)
    assert re.fullmatch(r"ab[0-9]{2}", text)


def test_a_partial_answer_ends_with_length(engine):
    options = GenerationOptions(grammar=ORDER, temperature=0.0)
    out = list(engine.generate(PROMPT, engine.params(options, 5, None)))
    assert out[-1].finish_reason == "length"
    assert "".join(o.text for o in out).startswith('{"')


def test_a_row_without_a_grammar_is_unchanged_beside_one(engine):
    """Rows with and without grammars in one batch, ruled ones between plain ones: each mask
    lands on its own row (a plain row answers as it does alone, each ruled one follows its
    own grammar)."""
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [t for o in engine.generate(PROMPT, SamplingParams(**kw)) for t in o.token_ids]
    digits, letters = r"[0-9]{2,6}", r"[a-z]{2,6}"
    rows = {
        "plain": SamplingParams(**kw),
        "order": engine.params(GenerationOptions(grammar=ORDER, temperature=0.0), 12, None),
        "plain2": SamplingParams(**kw),
        "digits": engine.params(GenerationOptions(grammar=GrammarSpec("regex", digits)), 12, 1),
        "letters": engine.params(GenerationOptions(grammar=GrammarSpec("regex", letters)), 12, 2),
    }
    for name, params in rows.items():
        engine.add(engine.new_sequence(name, PROMPT, params))
    got: dict[str, list[int]] = {name: [] for name in rows}
    text: dict[str, str] = {name: "" for name in rows}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.token_ids
            text[out.request_id] += out.text
    assert got["plain"] == got["plain2"] == alone and got["order"] != alone
    assert text["order"].startswith('{"'), text
    assert re.fullmatch(digits, text["digits"]) and re.fullmatch(letters, text["letters"]), text


def test_a_grammar_that_does_not_compile_is_a_limit_error(engine):
    for spec in (GrammarSpec("regex", "([a-z]", "guided_regex"),
                 GrammarSpec("grammar", "start: nowhere", "guided_grammar")):  # fmt: skip
        with pytest.raises(LimitError) as e:
            engine.params(GenerationOptions(grammar=spec), 10, None)
        assert e.value.problem.param == spec.param


# ---- over HTTP, through the OpenAI SDK --------------------------------------------------------
@pytest.fixture(scope="module")
def base(tiny_ar_and_dlm_server):
    return tiny_ar_and_dlm_server


def test_the_sdk_parses_chat_answers_into_the_model(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    for temperature in (0.0, 1.0):
        done = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "an order"}],
            response_format=Order,
            temperature=temperature,
            max_tokens=300,
            seed=7,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Order)


def test_the_sdk_parses_responses_answers_continued_from_the_session(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    kw = dict(model="tiny", text_format=Order, max_output_tokens=300, temperature=0.0)
    first = client.responses.parse(input="an order", **kw)
    assert first.status == "completed" and isinstance(first.output_parsed, Order)
    assert first.text.format.type == "json_schema"
    second = client.responses.parse(input="another", previous_response_id=first.id, **kw)
    assert isinstance(second.output_parsed, Order)


def test_every_spelling_streamed_and_not(base, engine):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base}{path}", json=body, timeout=120)

    completion = {"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 1.0}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 300,
            "temperature": 1.0}  # fmt: skip
    regex = r"[a-c]{2}[0-9]"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            r = post(path, {**body, **extra})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice.get("text", None) or choice.get("message", {}).get("content")
            assert re.fullmatch(regex, text) and choice["finish_reason"] == "stop", text
    r = post("/v1/completions", {**completion, "guided_choice": ["red", "green"], "n": 4})
    assert {c["text"] for c in r.json()["choices"]} <= {"red", "green"}
    for extra in json_schema_spellings(Order.model_json_schema(), "o"):
        with httpx.stream("POST", f"{base}/v1/chat/completions",
                          json={**chat, **extra, "stream": True}, timeout=120) as r:  # fmt: skip
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]  # fmt: skip
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        Order.model_validate_json(text)
    r = post("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
    _assert_a_json_object_or_its_prefix(engine, r.json()["choices"][0])


def _assert_a_json_object_or_its_prefix(engine, choice: dict) -> None:
    """Any JSON object has no bound on its length: a sampled answer that ends ("stop") is one,
    and an answer cut at max_tokens ("length") is a prefix the json_object grammar accepts."""
    text = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict), text
        return
    assert choice["finish_reason"] == "length", choice
    matcher = engine.grammars.matcher(GrammarSpec("json_object"))
    assert matcher.consume_tokens(engine.tokenizer.encode(text, add_special_tokens=False)), text
    assert not matcher.is_error() and not matcher.is_accepting(), text


def test_bad_structured_outputs_are_400s(base):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8}
    bad = [
        ({"guided_regex": "([a-z]"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ]
    for extra, param in bad:
        r = httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    # A diffusion model takes grammars too (tests/test_dlm_structured.py), and refuses a bad one.
    r = httpx.post(f"{base}/v1/completions", json={**body, "model": "dream",
                   "guided_regex": "([a-z]"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
