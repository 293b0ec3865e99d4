"""Structured outputs on diffusion models (issue 56 item 4): a block commits only tokens its
grammar allows, checked left to right (engine.decoding.dlm_grammar). On tiny random Dream and
LLaDA models (whose unconstrained answers are noise, so every structure comes from the grammar)
in each decoding mode, greedy and sampled; on the shipped student's own tasks; over HTTP."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import httpx
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

import tiny_models
from cdlm_serve.bench import cdlm_suites
from cdlm_serve.engine.decoding import DLMEngine, DLMParams, GenerationOptions, GrammarSpec
from cdlm_serve.engine.decoding.dlm_grammar import check
from cdlm_serve.models.sources import resolve
from cdlm_serve.train.data import KINDS
from cdlm_serve.train.tasks import TASKS, exact_match
from conftest import json_schema_spellings, running_server

PROMPT = list(b"Pick: ")
MASK, EOS = tiny_models.MASK_ID, tiny_models.EOS_ID
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe not"]


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["cat", "dog"]
    name: str = Field(max_length=5)
    ages: list[Annotated[int, Field(ge=0, le=99)]] = Field(min_length=1, max_length=2)
    indoor: bool


PET = GrammarSpec("json_schema", json.dumps(Pet.model_json_schema()))


@pytest.fixture(scope="module")
def engine(tiny_dlm_engine):
    return tiny_dlm_engine


def _checked_prefix_is_valid(engine: DLMEngine, spec: GrammarSpec) -> None:
    """Every running row's final tokens before its first masked one are a prefix the grammar
    accepts (checked with a fresh matcher, not the engine's)."""
    for group in engine.running.values():
        for seq in group:
            answer = seq.answer.tolist()
            prefix = answer[: answer.index(MASK) if MASK in answer else len(answer)]
            prefix = prefix[: seq.params.max_tokens]
            if EOS in prefix:  # an accepted end: what the grammar saw is before it
                prefix = prefix[: prefix.index(EOS)]
            assert engine.grammars.matcher(spec).validate_tokens(prefix) == len(prefix), bytes(
                t for t in prefix if t < 256
            )


def _decode(engine: DLMEngine, spec: GrammarSpec | None, n: int, **kw) -> list[tuple]:
    """n answers decoded together under `spec` (seeds 0..n-1): (text, finish, token ids,
    steps per block) each; the checked prefix is verified after every step, and the run is
    bounded (a regression fails, it does not hang)."""
    seqs = []
    for i in range(n):
        params = engine.params(GenerationOptions(grammar=spec), kw.get("max_tokens", 160), i)
        for k, v in kw.items():
            setattr(params, k, v)
        seqs.append(engine.new_sequence(f"r{i}", PROMPT, params))
        engine.add(seqs[-1])
    texts = {s.id: "" for s in seqs}
    ids: dict[str, list[int]] = {s.id: [] for s in seqs}
    finish: dict[str, str] = {}
    for _ in range(4 * kw.get("max_tokens", 160)):  # two steps a position at most
        if not engine.has_work():
            break
        for out in engine.step():
            texts[out.request_id] += out.text
            ids[out.request_id] += out.token_ids
            finish[out.request_id] = out.finish_reason or ""
        if spec is not None:
            _checked_prefix_is_valid(engine, spec)
    assert not engine.has_work()
    return [(texts[s.id], finish[s.id], ids[s.id], s.steps_per_block) for s in seqs]


@pytest.mark.parametrize(
    ("decoding", "temperature"),
    [("cdlm", 0.0), ("cdlm", 1.0), ("fast_dllm", 0.0), ("vanilla", 1.0)],
)
def test_regex_choice_and_schema_answers_follow_their_grammar(engine, decoding, temperature):
    # A low threshold: several positions a step, many of them refused (a random model).
    kw = dict(decoding=decoding, temperature=temperature, block_size=8, threshold=0.01)
    cases = [
        (GrammarSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t)),
        (GrammarSpec("choice", json.dumps(CHOICES)), lambda t: t in CHOICES),
        (PET, lambda t: Pet.model_validate_json(t)),
    ]
    for spec, valid in cases:
        for text, finish, _, steps_per_block in _decode(engine, spec, 2, max_tokens=96, **kw):
            assert finish == "stop" and valid(text), (spec.kind, text, finish)
            # A position is refused at most once: at most two steps per position of a block.
            assert max(steps_per_block) <= 2 * 8, steps_per_block


def test_a_row_without_a_grammar_is_unchanged_beside_one(engine):
    kw = dict(decoding="cdlm", block_size=8, threshold=0.3, max_tokens=24, ignore_eos=True)
    ((_, _, alone, _),) = _decode(engine, None, 1, **kw)
    plain = engine.new_sequence("plain", PROMPT, DLMParams(**kw))
    ruled = engine.params(GenerationOptions(grammar=GrammarSpec("regex", REGEX)), 24, None)
    for k, v in kw.items():
        setattr(ruled, k, v)
    engine.add(engine.new_sequence("ruled", PROMPT, ruled))
    engine.add(plain)
    got: dict[str, list[int]] = {"plain": [], "ruled": []}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got["plain"] == alone
    assert re.fullmatch(REGEX, bytes(t for t in got["ruled"] if t < 256).decode())


def test_a_partial_answer_ends_with_length(engine):
    ((text, finish, ids, _),) = _decode(engine, PET, 1, max_tokens=5, block_size=8)
    assert finish == "length" and len(ids) == 5 and text.startswith('{"')


@pytest.mark.parametrize("order", ["any", "leftmost"])
def test_leftmost_order_also_follows_the_grammar(engine, order):
    engine.grammar_order = order
    try:
        for text, finish, _, _ in _decode(engine, PET, 2, block_size=8, threshold=0.01):
            assert finish == "stop"
            Pet.model_validate_json(text)
    finally:
        engine.grammar_order = "any"


def _sequence(engine: DLMEngine, spec: GrammarSpec, answer: bytes | list[int]):
    params = engine.params(GenerationOptions(grammar=spec), 8, None)
    params.block_size = 8
    seq = engine.new_sequence("s", PROMPT, params)
    tokens = list(answer) + [MASK] * (8 - len(answer))
    seq.answer[:] = torch.tensor(tokens)
    return seq


def test_the_check_masks_the_first_refused_token_again(engine):
    digits = GrammarSpec("regex", "[0-9]+")
    seq = _sequence(engine, digits, b"12x45")
    assert check(seq, MASK, 8, "any") == 1
    assert seq.answer.tolist()[:5] == [*b"12", MASK, *b"45"] and seq.grammar_checked == 2
    assert seq.grammar_end is None
    seq = _sequence(engine, digits, b"12x45")
    assert check(seq, MASK, 8, "leftmost") == 3  # the rest of the run goes with it
    assert seq.answer.tolist()[:5] == [*b"12", MASK, MASK, MASK]
    # Checked only up to the first masked position: an unchecked token after it waits.
    seq = _sequence(engine, digits, [*b"1", MASK, *b"x"])
    assert check(seq, MASK, 8, "any") == 0 and seq.answer.tolist()[2] == ord("x")
    assert seq.grammar_checked == 1


def test_a_stop_token_ends_the_answer_only_where_the_grammar_may_end(engine):
    seq = _sequence(engine, GrammarSpec("regex", "[0-9]{2,3}"), [*b"1", EOS])
    assert check(seq, MASK, 8, "any") == 1 and seq.answer.tolist()[1] == MASK
    seq = _sequence(engine, GrammarSpec("regex", "[0-9]{2,3}"), [*b"12", EOS, *b"7"])
    assert check(seq, MASK, 8, "any") == 0 and seq.grammar_end == 2
    # A complete grammar ends the answer after its last token, whatever follows.
    seq = _sequence(engine, GrammarSpec("regex", "[0-9]{2}"), b"123")
    assert check(seq, MASK, 8, "any") == 0 and seq.grammar_end == 2
    # Not past the answer's limit (max_tokens): what lies there is never checked.
    seq = _sequence(engine, GrammarSpec("regex", "[0-9]+"), b"12x")
    assert check(seq, MASK, 2, "any") == 0 and seq.grammar_checked == 2


# ---- the shipped student on its own tasks ------------------------------------------------------
TASK_REGEX = cdlm_suites.ANSWER_FORMATS


def test_the_student_answers_its_tasks_under_their_formats():
    """The student (cdlm, B = 8, tau 0.9) under a regex of each task's answer format: every
    answer matches, exact match is no worse than unconstrained, and the steps are no more."""
    engine = cdlm_suites.engine_for(resolve("cdlm-student"), torch.float32, batch=12)
    for suite, regex in TASK_REGEX.items():
        problems = TASKS[suite].held_out()[:12]
        result = {}
        for spec in (None, GrammarSpec("regex", regex)):
            for i, ex in enumerate(problems):
                params = engine.params(GenerationOptions(grammar=spec), KINDS[suite].answer_len, 0)
                ids = engine.tokenizer.encode(ex.prompt, add_special_tokens=False)
                engine.add(engine.new_sequence(str(i), ids, params))
            texts = {str(i): "" for i in range(len(problems))}
            steps: dict[str, int] = {}
            while engine.has_work():
                for out in engine.step():
                    texts[out.request_id] += out.text
                    steps[out.request_id] = out.steps
            answers = [texts[str(i)] for i in range(len(problems))]
            em = sum(exact_match(a, ex.answer) for a, ex in zip(answers, problems, strict=True))
            result[spec is not None] = (answers, em, sum(steps.values()))
        answers, em, steps_ruled = result[True]
        assert all(re.fullmatch(regex, a) for a in answers), answers
        assert em >= result[False][1] and steps_ruled <= result[False][2], (suite, result)


# ---- over HTTP -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tiny_ar_and_dlm_server):
    return tiny_ar_and_dlm_server


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def _streamed(base: str, path: str, body: dict) -> tuple[str, str]:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    return text, choices[-1]["finish_reason"]


def test_every_spelling_on_a_diffusion_model_streamed_and_not(base):
    completion = {"model": "dream", "prompt": "x", "max_tokens": 64, "block_size": 8}
    chat = {"model": "dream", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 160, "block_size": 8, "temperature": 1.0, "seed": 3}  # fmt: skip
    for extra in ({"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}):
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            r = _post(base, path, {**body, **extra})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice.get("text", None) or choice.get("message", {}).get("content")
            assert re.fullmatch(REGEX, text) and choice["finish_reason"] == "stop", text
            text, finish = _streamed(base, path, {**body, **extra})
            assert re.fullmatch(REGEX, text) and finish == "stop", text
    r = _post(base, "/v1/completions", {**completion, "guided_choice": CHOICES, "n": 3,
                                        "temperature": 1.0, "seed": 1})  # fmt: skip
    assert r.status_code == 200 and {c["text"] for c in r.json()["choices"]} <= set(CHOICES)
    for extra in json_schema_spellings(Pet.model_json_schema(), "p"):
        r = _post(base, "/v1/chat/completions", {**chat, **extra})
        assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
        Pet.model_validate_json(r.json()["choices"][0]["message"]["content"])
        text, finish = _streamed(base, "/v1/chat/completions", {**chat, **extra})
        assert finish == "stop"
        Pet.model_validate_json(text)
    r = _post(base, "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_a_diffusion_model_refuses_a_bad_grammar_and_the_sampling_options(base):
    body = {"model": "dream", "prompt": "x", "max_tokens": 8}
    for extra, param in (({"guided_regex": "([a-z]"}, "guided_regex"),
                         ({"guided_regex": "a+", "logit_bias": {"5": 1}}, "logit_bias"),
                         ({"guided_regex": "a+", "logprobs": 2}, "logprobs")):  # fmt: skip
        r = _post(base, "/v1/completions", {**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_the_student_answers_under_a_regex_through_the_server():
    with running_server("--model", "cdlm-student", "--device", "cpu") as base:
        problems = TASKS["addition3"].held_out()[:4]
        body = {
            "model": "cdlm-student",
            "prompt": [ex.prompt for ex in problems],
            "max_tokens": KINDS["addition3"].answer_len,
            "structured_outputs": {"regex": TASK_REGEX["addition3"]},
        }
        out = _post(base, "/v1/completions", body).json()
        answers = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        assert all(re.fullmatch(TASK_REGEX["addition3"], a) for a in answers), answers
        assert sum(exact_match(a, ex.answer) for a, ex in zip(answers, problems, strict=True)) >= 3
        text, finish = _streamed(base, "/v1/completions", {**body, "prompt": problems[0].prompt})
        assert finish == "stop" and re.fullmatch(TASK_REGEX["addition3"], text), text
