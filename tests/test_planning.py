"""The planner (server/planning.py) on an engine of neither kind: a request body read once into
`GenerationOptions`, choices planned through the `Engine` contract alone (the engine makes its
parameters and says what it cannot take), run through it, and gathered into one answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import tiny_models
from cdlm_serve.engine import limits
from cdlm_serve.engine.decoding import EngineOutput, GenerationOptions
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.server import planning
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.schemas import ChatCompletionRequest, CompletionRequest


@dataclass
class FakeParams:
    max_tokens: int
    seed: int | None
    options: GenerationOptions


@dataclass
class FakeEngine:
    """An `Engine` that is neither AREngine nor DLMEngine: the planner must need no more."""

    max_model_len: int = 64
    prefix_cache: None = None
    refuse: limits.LimitProblem | None = None  # what `problem` says of every request
    clash: limits.LimitProblem | None = None  # what `params` raises
    built: list[tuple[str, list[int], Any]] = field(default_factory=list)
    checked: list[tuple[int, int]] = field(default_factory=list)  # (prompt, history)

    def params(self, options: GenerationOptions, max_tokens: int, seed: int | None) -> FakeParams:
        if self.clash is not None:
            raise limits.LimitError(self.clash)
        return FakeParams(max_tokens, seed, options)

    def problem(self, prompt: int, params: FakeParams, history: int = 0):
        self.checked.append((prompt, history))
        return self.refuse

    def new_sequence(self, request_id, prompt, params, aborted=None, session=None, append=True):
        self.built.append((request_id, prompt, params))
        return request_id, prompt, params


class FakeThread:
    """The engine thread's `stream`: builds the sequence, then answers each prompt with its
    own first token's text twice, one output per token, the last one finishing."""

    def __init__(self, engine: FakeEngine, hang: bool = False):
        self.engine, self.hang, self.count = engine, hang, 0

    async def stream(self, build):
        request_id, prompt, _ = build(f"fake-{self.count}", lambda: False)
        self.count += 1
        if self.hang:
            await asyncio.Event().wait()
        yield EngineOutput(request_id, [prompt[0]], chr(prompt[0]))
        yield EngineOutput(request_id, [prompt[0]], chr(prompt[0]), "length", cached_tokens=1)


class FakeMetrics:
    def __init__(self):
        self.requests: list[tuple[str, int, int, str]] = []

    def observe_request(self, model, prompt_tokens, completion_tokens, reason, seconds):
        self.requests.append((model, prompt_tokens, completion_tokens, reason))


def _served(engine: FakeEngine | None = None, hang: bool = False) -> ServedModel:
    engine = engine or FakeEngine()
    config = SimpleNamespace(is_diffusion=False, vocab_size=300, bos_token_id=None)
    return ServedModel(
        name="fake",
        path=Path("."),
        model=None,  # type: ignore[arg-type]  # planning never runs a model
        tokenizer=tiny_models.byte_tokenizer(),
        config=config,  # type: ignore[arg-type]
        max_model_len=engine.max_model_len,
        engine=engine,
        thread=FakeThread(engine, hang),  # type: ignore[arg-type]
        created=0,
    )


def _completion(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "fake", "prompt": "ab", **body})


def test_the_body_is_read_once_into_neutral_options():
    options = planning.generation_options(_completion(stop="x", n=2, steps=4), 8, None)
    assert options.temperature is None  # unset: the engine's own default
    assert options.stop == ("x",) and options.n == 2 and options.max_tokens == 8
    assert options.diffusion_options() == ["steps"]
    null = planning.generation_options(_completion(temperature=None), 8, None)
    assert null.temperature == 1.0  # set to null: OpenAI's default
    chat = ChatCompletionRequest.model_validate(
        {"model": "fake", "messages": [{"role": "user", "content": "q"}], "temperature": 0.5}
    )
    assert planning.generation_options(chat, None, 2).temperature == 0.5


def test_any_engine_plans_through_its_contract():
    served = _served()
    req = _completion(prompt=["ab", "c"], n=2, seed=5, max_tokens=4, stop=["z"])
    choices = planning.plan_completion(served, req)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert [c.prompt_text for c in choices] == ["ab", "ab", "c", "c"]
    params = [c.params for c in choices]
    assert all(isinstance(p, FakeParams) for p in params)  # the engine's own kind, as made
    assert [p.seed for p in params] == [5, 6, 5, 6] and {p.max_tokens for p in params} == {4}
    assert params[0].options == planning.generation_options(req, 4, None)
    engine = served.engine
    assert engine.checked == [(2, 0), (2, 0), (1, 0), (1, 0)]  # type: ignore[attr-defined]


def test_what_the_engine_cannot_take_is_a_400_naming_the_parameter():
    refused = FakeEngine(refuse=limits.LimitProblem("blocks do not fit", "block_size", "c"))
    with pytest.raises(APIError) as e:
        planning.plan_completion(_served(refused), _completion())
    assert (e.value.status, e.value.message, e.value.param, e.value.code) == (
        400,
        "blocks do not fit",
        "block_size",
        "c",
    )
    clash = FakeEngine(clash=limits.LimitProblem("alg and remasking", "alg"))
    with pytest.raises(APIError) as e:
        planning.plan_completion(_served(clash), _completion())
    assert (e.value.status, e.value.param) == (400, "alg")
    # The context comes first, whatever the engine: the API's words for it.
    with pytest.raises(APIError) as e:
        planning.plan_completion(_served(), _completion(max_tokens=63))
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


def test_choices_run_through_the_contract_and_are_gathered_into_one_answer():
    served, metrics = _served(), FakeMetrics()
    choices = planning.plan_completion(served, _completion(prompt=["ab", "c"], n=2, max_tokens=2))
    seen: list[int] = []
    answer = asyncio.run(
        planning.gather(served, choices, 2, metrics, lambda i, out: seen.append(i))  # type: ignore[arg-type]
    )
    built = served.engine.built  # type: ignore[attr-defined]
    assert [(prompt, params) for _, prompt, params in built] == [
        (c.prompt_ids, c.params) for c in choices
    ]
    assert answer.texts == ["aa", "aa", "cc", "cc"]
    assert answer.finish == ["length"] * 4
    assert sorted(seen) == [0, 0, 1, 1, 2, 2, 3, 3]  # every output, for the route's own parts
    # Each prompt counted once, however many samples (OpenAI's accounting); cached per prompt.
    assert answer.usage == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert metrics.requests == [("fake", 3, 8, "length")]


def test_a_gathered_answer_whose_client_left_is_recorded_as_an_abort():
    served, metrics = _served(hang=True), FakeMetrics()
    choices = planning.plan_completion(served, _completion(max_tokens=2))

    async def leave() -> None:
        task = asyncio.ensure_future(planning.gather(served, choices, 1, metrics))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave())
    assert metrics.requests == [("fake", 2, 0, "abort")]
