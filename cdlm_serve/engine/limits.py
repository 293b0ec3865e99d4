"""The limits a request must fit, checked in one place: the server plans a request with them
(to answer 400 with the right parameter before anything is queued) and each engine checks
them again in `new_sequence` (its callers are not only the server: benches, training). A
prompt becomes checked token ids here too (`prompt_ids`), for every route that takes one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


def steps_problem(steps: int, block_size: int, answer: int) -> str | None:
    """Why `steps` cannot decode an answer of `answer` tokens (a whole number of blocks), or
    None: the steps spread evenly over the blocks (as LLaDA requires), at most one per answer
    token (each step is a forward pass)."""
    blocks = answer // block_size
    if steps % blocks == 0 and blocks <= steps <= answer:
        return None
    return (
        f"steps ({steps}) must be a multiple of the number of blocks ({blocks}: the answer of "
        f"{answer} tokens in blocks of {block_size}) and at most {answer}"
    )


@dataclass(frozen=True, slots=True)
class LimitProblem:
    message: str
    param: str
    code: str | None = None


class LimitError(ValueError):
    """A request an engine refuses, with the parameter at fault (the server's 400 names it)."""

    def __init__(self, problem: LimitProblem):
        super().__init__(problem.message)
        self.problem = problem


def context_problem(limit: int, prompt: int, wanted: int, note: str = "") -> LimitProblem:
    """OpenAI's words for a request longer than the context."""
    return LimitProblem(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + wanted} tokens ({prompt} in the prompt, {wanted} in the completion{note}). "
        "Please reduce the prompt or max_tokens.",
        "max_tokens",
        "context_length_exceeded",
    )


def ar_problem(
    prompt: int, max_tokens: int | None, history: int, limit: int, clamp: bool = False
) -> LimitProblem | None:
    """An autoregressive request of `prompt` new tokens after `history` (a session's) ones.
    `max_tokens` None asks for the rest of the context; with `clamp` a longer one is cut to
    it (the engine's way), else refused (the API's way)."""
    if prompt < 1:
        return LimitProblem("prompt is empty", "prompt")
    room = limit - history - prompt
    wanted = room if max_tokens is None else max_tokens
    if room < 1 or (wanted > room and not clamp):
        return context_problem(limit, history + prompt, wanted)
    if wanted < 1:
        return LimitProblem("max_tokens must be at least 1", "max_tokens")
    return None


def dlm_answer_length(max_tokens: int, block_size: int) -> int:
    """The answer a diffusion engine decodes: max_tokens rounded up to whole blocks."""
    return math.ceil(max_tokens / block_size) * block_size


def dlm_problem(
    prompt: int, max_tokens: int | None, block_size: int, steps: int | None, limit: int
) -> LimitProblem | None:
    """A diffusion request: the prompt and the whole blocks of its answer must fit the context,
    and a fixed number of steps must divide over them."""
    if prompt < 1:
        return LimitProblem("a diffusion model needs a non-empty prompt", "prompt")
    if block_size < 1:
        return LimitProblem("block_size must be >= 1", "block_size")
    room = limit - prompt
    wanted = room if max_tokens is None else max_tokens
    if room < 1 or wanted > room:
        return context_problem(limit, prompt, wanted)
    if wanted < 1:
        return LimitProblem("max_tokens must be at least 1", "max_tokens")
    answer = dlm_answer_length(wanted, block_size)
    if answer > room:
        return context_problem(limit, prompt, answer, ", max_tokens rounded up to whole blocks")
    if steps is not None:
        problem = steps_problem(steps, block_size, answer)
        if problem is not None:
            return LimitProblem(problem, "steps")
    return None


class Tokenizing(Protocol):
    """What checking a prompt reads of a served model (`engine.served_model.ServedModel`)."""

    max_model_len: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of a text; ValueError for one too long to tokenize for this context."""
        ...

    def sequence_start(self, ids: list[int]) -> list[int]:
        """`ids` as the start of a sequence (the tokenizer's BOS first, where it adds one)."""
        ...


def prompt_ids(
    model: Tokenizing,
    prompt: str | list[int],
    param: str = "prompt",
    start: bool = True,
    stored: str | None = None,
) -> list[int] | LimitProblem:
    """A prompt (a text, or token ids taken as they are) as token ids, or why it cannot be one,
    naming `param`. A text that `start`s a sequence gets the tokenizer's BOS where it adds one.
    A prompt `stored` whole in a session's cache, with no answer planned after it to check it
    (a session's first prompt, a conversation to compact), must leave the context a slot: its
    problem names it by `stored` ("prompt")."""
    if isinstance(prompt, str):
        try:
            ids = model.encode(prompt)
        except ValueError as e:  # too long to tokenize at all (`ServedModel.encode`)
            return LimitProblem(str(e), param, "context_length_exceeded")
        ids = model.sequence_start(ids) if start else ids
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            return LimitProblem(
                f"token id {bad} is outside the vocabulary [0, {model.vocab_size})", param
            )
    if stored is not None and len(ids) >= model.max_model_len:
        return LimitProblem(
            f"{stored} of {len(ids)} tokens does not fit the model's context "
            f"({model.max_model_len})",
            param,
            "context_length_exceeded",
        )
    return ids
