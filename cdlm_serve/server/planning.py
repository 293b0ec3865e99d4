"""What a request becomes for the engine, shared by completions and chat: its body read once
into the engines' neutral `GenerationOptions` (`generation_options`), its prompts into checked
token ids (`engine/limits.py` `prompt_ids`), one `Choice` per (prompt, sample) planned with
every limit checked up front (`plan_choices`; each engine makes its own parameters and says
what it cannot take, through the `Engine` contract alone), all submitted at once so the engine
batches them (`run_choices`), gathered into one answer (`gather`) and counted for usage and
metrics (`UsageCount`, `usage`, `record`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cdlm_serve.engine import limits
from cdlm_serve.engine.decoding import (
    DIFFUSION_OPTIONS,
    EngineOutput,
    GenerationOptions,
    GenerationParams,
    GrammarSpec,
)
from cdlm_serve.engine.engine_thread import QueueFull
from cdlm_serve.engine.served_model import ServedModel
from cdlm_serve.engine.sessions import Session
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.metrics import Metrics
from cdlm_serve.server.request_limits import MAX_CHOICES
from cdlm_serve.server.schemas import CompletionRequest, GenerationRequest
from cdlm_serve.server.structured import grammar_of


@dataclass(slots=True)
class Choice:
    """One (prompt, sample) pair of a request: `n` choices per prompt, in OpenAI's order."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: GenerationParams  # the engine's own kind (`Engine.params`)
    session: Session | None = None  # continue from this session's cache
    append: bool = True


@dataclass(slots=True)
class UsageCount:
    """What a request produced, for usage and metrics."""

    completion_tokens: int = 0
    steps: int = 0
    reasons: list[str] = field(default_factory=list)
    cached: dict[int, int] = field(default_factory=dict)  # choice -> prompt tokens cached

    def add(self, out: EngineOutput, choice: int) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.cached_tokens is not None:
            self.cached[choice] = out.cached_tokens
        if out.finish_reason is not None:
            self.reasons.append(out.finish_reason)
            self.steps += out.steps or 0


# ---- the request, read once where it enters --------------------------------------------------
def generation_options(
    req: GenerationRequest, max_tokens: int | None, logprobs: int | None
) -> GenerationOptions:
    """What a completions or chat body asks of decoding, in the engines' terms; the body's own
    `max_tokens` and `logprobs` (each route spells them its own way)."""
    # Unset: the engine's default (a diffusion model decodes greedily); null: OpenAI's, 1.
    temperature = None
    if "temperature" in req.model_fields_set:
        temperature = 1.0 if req.temperature is None else req.temperature
    return GenerationOptions(
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=tuple(req.stop or ()),
        seed=req.seed,
        n=req.n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        ignore_eos=req.ignore_eos,
        cache_salt=req.cache_salt,
        # Each only where the body asks for it: a diffusion model refuses them.
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        repetition_penalty=None if req.repetition_penalty == 1.0 else req.repetition_penalty,
        logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None,
        min_p=req.min_p or None,
        grammar=grammar_of(req),
        decoding=req.decoding,
        block_size=req.block_size,
        threshold=req.threshold,
        steps=req.steps,
        alg=req.alg,
        alg_temp=req.alg_temp,
        remasking=req.remasking,
    )


def reject_unsupported(
    served: ServedModel, options: GenerationOptions, unsupported: dict[str, bool]
) -> None:
    autoregressive_only: list[str] = []  # what a diffusion model refuses
    if served.is_diffusion:
        if any(unsupported.get(k) for k in ("logprobs", "top_logprobs")):
            unsupported["logprobs"] = True  # diffusion decoding has no per-token distribution
        named = options.autoregressive_options()
        autoregressive_only = ["logprobs", "tools", *named]
        unsupported |= dict.fromkeys(named, True)
    else:
        unsupported |= dict.fromkeys(options.diffusion_options(), True)
    for param, used in unsupported.items():
        if used:
            reason = (
                "only for diffusion models" if param in DIFFUSION_OPTIONS else "by this server yet"
            )
            if param in autoregressive_only:
                reason = "for diffusion models"
            raise APIError(400, f"{param} is not supported {reason}", param=param)


def limit_error(problem: limits.LimitProblem) -> APIError:
    """A request's problem with a limit (engine/limits.py) as the API's 400."""
    return APIError(400, problem.message, param=problem.param, code=problem.code)


def checked_prompt(
    served: ServedModel,
    prompt: str | list[int],
    param: str = "prompt",
    start: bool = True,
    stored: str | None = None,
) -> list[int]:
    """`limits.prompt_ids` for a route: the prompt's checked token ids, or its 400."""
    ids = limits.prompt_ids(served, prompt, param, start, stored)
    if isinstance(ids, limits.LimitProblem):
        raise limit_error(ids)
    return ids


def request_prompts(
    served: ServedModel, prompt: Any, start: bool = True
) -> list[tuple[list[int], str]]:
    """Each prompt of a request (string, list of strings, token ids, list of id lists) as
    (token ids, text). A text that `start`s a sequence gets the tokenizer's BOS where it adds
    one (`ServedModel.sequence_start`); token ids are taken as they are."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for p in items:
        ids = checked_prompt(served, p, start=start)
        if isinstance(p, list):
            out.append((ids, served.tokenizer.decode(p)))
            continue
        if not ids and served.config.bos_token_id is not None:  # a completion of nothing
            ids = [int(served.config.bos_token_id)]
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        out.append((ids, p))
    return out


def forcing(options: GenerationOptions, grammar: GrammarSpec | None) -> GenerationOptions:
    """The options with a call forced by `tool_choice` (its grammar), which no structured
    output may also shape."""
    if grammar is None:
        return options
    if options.grammar is not None:
        message = f"a forced tool_choice cannot go with {options.grammar.param}"
        raise APIError(400, message, param=grammar.param)
    return replace(options, grammar=grammar)


def plan_completion(
    served: ServedModel, req: CompletionRequest, forced: GrammarSpec | None = None
) -> list[Choice]:
    """`forced`: the grammar of a call `tool_choice` forces (the Responses API's)."""
    options = forcing(generation_options(req, req.max_tokens, req.logprobs), forced)
    if req.echo and req.logprobs is not None:  # the echoed prompt's own, as it is prefilled
        options = replace(options, prompt_logprobs=req.logprobs)
    reject_unsupported(
        served,
        options,
        {
            "suffix": req.suffix is not None,
            "best_of": req.best_of is not None and req.best_of != req.n,
            "logprobs": served.is_diffusion and req.logprobs is not None,
        },
    )
    return plan_choices(served, options, request_prompts(served, req.prompt))


def plan_session(
    served: ServedModel,
    req: CompletionRequest,
    session: Session,
    forced: GrammarSpec | None = None,
) -> list[Choice]:
    """One choice continuing from a session: the session's next input token (sampled last time,
    never run through the model) comes first."""
    options = forcing(generation_options(req, req.max_tokens, req.logprobs), forced)
    reject_unsupported(
        served,
        options,
        {"echo": req.echo, "logprobs": req.logprobs is not None, "suffix": req.suffix is not None},
    )
    # A continuation: no BOS, unless the session is empty (its first text starts it).
    ((ids, text),) = request_prompts(served, req.prompt, start=not session.logical_length)
    if session.next_input is not None:
        ids = [session.next_input, *ids]
    return [session_choice(served, options, ids, text, session, req.append)]


# ---- planning: the neutral request, any engine --------------------------------------------------
def _refuse(problem: limits.LimitProblem | None) -> None:
    if problem is not None:
        raise limit_error(problem)


def _params(
    served: ServedModel,
    options: GenerationOptions,
    ids: list[int],
    wanted: int,
    seed: int | None,
    history: int = 0,
) -> GenerationParams:
    """The engine's parameters for one choice, refused (400) where the engine could not
    decode them (a diffusion engine's whole blocks, its steps)."""
    engine = served.engine
    try:
        params: GenerationParams = engine.params(options, wanted, seed)
    except limits.LimitError as e:  # options that cannot go together
        raise limit_error(e.problem) from None
    _refuse(engine.problem(len(ids), params, history))
    return params


def plan_choices(
    served: ServedModel, options: GenerationOptions, prompts: list[tuple[list[int], str]]
) -> list[Choice]:
    limit, n = served.max_model_len, options.n
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices per request",
            param="n",
        )
    choices = []
    for i, (ids, text) in enumerate(prompts):
        _refuse(limits.ar_problem(len(ids), options.max_tokens, 0, limit))
        wanted = options.max_tokens if options.max_tokens is not None else limit - len(ids)
        for j in range(n):
            seed = None if options.seed is None else options.seed + j
            params = _params(served, options, ids, wanted, seed)
            choices.append(Choice(i * n + j, ids, text, params))
    return choices


def session_choice(
    served: ServedModel,
    options: GenerationOptions,
    ids: list[int],
    text: str,
    session: Session,
    append: bool,
) -> Choice:
    """The one choice of a session's continuation: `ids` after the session's tokens."""
    history = session.logical_length
    _refuse(limits.ar_problem(len(ids), options.max_tokens, history, served.max_model_len))
    room = served.max_model_len - history - len(ids)
    wanted = options.max_tokens if options.max_tokens is not None else room
    params = _params(served, options, ids, wanted, options.seed, history)
    return Choice(0, ids, text, params, session, append)


# ---- running ---------------------------------------------------------------------------------
async def run_choice(served: ServedModel, choice: Choice) -> AsyncIterator[EngineOutput]:
    """The engine outputs of one choice, in order; the last carries the finish reason."""

    def build(request_id: str, aborted: Callable[[], bool]) -> Any:
        # The engine made the choice's parameters (`_params`): they are its own kind.
        return served.engine.new_sequence(
            request_id, choice.prompt_ids, choice.params, aborted, choice.session, choice.append
        )

    try:
        async for out in served.thread.stream(build):
            yield out
    except QueueFull as e:
        raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
    except ValueError as e:  # the engine refused the request (limits it checks itself)
        raise APIError(400, str(e)) from None


async def prefill_session(served: ServedModel, session: Session, ids: list[int]) -> None:
    """`ids` into the (held) session's cache after what it holds: an AR sequence that only
    prefills (max_tokens 0), so it goes through the engine's chunked prefill and step budget
    beside the model's other requests, and writes back like any answer."""
    params = served.engine.params(GenerationOptions(temperature=0.0), 0, None)
    finish = None
    async for out in run_choice(served, Choice(0, ids, "", params, session)):
        finish = out.finish_reason or finish
    if finish != "length":  # the engine dropped it (shutting down): nothing was written
        raise APIError(503, "the model's engine stopped before the prompt was prefilled")


async def run_choices(
    served: ServedModel, choices: list[Choice]
) -> AsyncIterator[tuple[int, EngineOutput]]:
    """All choices at once (the engine batches them); (choice index, output) as they come."""
    if len(choices) == 1:
        async for out in run_choice(served, choices[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()  # an output, error or `done`
    done = object()

    async def pump(i: int, choice: Choice) -> None:
        try:
            async for out in run_choice(served, choice):
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, EngineOutput)
                yield i, item
    finally:
        for t in tasks:  # the client went away or a choice failed: stop the others too
            t.cancel()


@dataclass(slots=True)
class Gathered:
    """A request's answer gathered whole (not streamed): each choice's text and finish reason,
    and the usage, as `usage` counts it."""

    texts: list[str]
    finish: list[str | None]
    usage: dict[str, Any]


def _ignore(choice: int, out: EngineOutput) -> None:
    """No route-specific reading of the outputs."""


async def gather(
    served: ServedModel,
    choices: list[Choice],
    n: int,
    metrics: Metrics | None,
    on_output: Callable[[int, EngineOutput], None] = _ignore,
) -> Gathered:
    """All choices run to the end (`run_choices`), for a body that answers them at once,
    completions and chat alike: `on_output(choice, output)` sees each output (the route's own
    parts: logprobs). The request is recorded however it ends; a cancelled one (its client went
    away) as an abort."""
    started = time.perf_counter()
    tally = UsageCount()
    texts: list[list[str]] = [[] for _ in choices]
    finish: list[str | None] = [None] * len(choices)
    try:
        async for i, out in run_choices(served, choices):
            texts[i].append(out.text)
            tally.add(out, i)
            finish[i] = out.finish_reason or finish[i]
            on_output(i, out)
    except asyncio.CancelledError:
        record(metrics, served, usage(served, choices, n, tally), tally, started, len(choices))
        raise
    body = usage(served, choices, n, tally)
    record(metrics, served, body, tally, started, len(choices))
    return Gathered(["".join(t) for t in texts], finish, body)


def new_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(served: ServedModel, choices: list[Choice], n: int, tally: UsageCount) -> dict[str, Any]:
    # Each prompt counts once, however many samples were drawn from it (OpenAI's accounting).
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[::n])
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tally.completion_tokens,
        "total_tokens": prompt_tokens + tally.completion_tokens,
    }
    if served.is_diffusion:
        body["steps"] = tally.steps
    else:
        # Per prompt, the most any of its samples found in the prefix cache (its samples are
        # admitted together, so they usually agree).
        cached = sum(
            max((tally.cached.get(i, 0) for i in range(p, min(p + n, len(choices)))), default=0)
            for p in range(0, len(choices), n)
        )
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def record(
    metrics: Metrics | None,
    served: ServedModel,
    body: dict[str, int],
    tally: UsageCount,
    started: float,
    n_choices: int,
) -> None:
    """Count a finished request; one whose choices did not all finish was aborted."""
    if metrics is None:
        return
    complete = len(tally.reasons) == n_choices and "abort" not in tally.reasons
    reason = tally.reasons[-1] if complete else "abort"
    metrics.observe_request(
        served.name,
        body["prompt_tokens"],
        body["completion_tokens"],
        reason,
        time.perf_counter() - started,
    )
