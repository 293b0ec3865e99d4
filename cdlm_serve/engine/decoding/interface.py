"""The contract between the server and an engine: what both engines (autoregressive, diffusion)
implement and what they hand back, field by field.

An engine decodes many requests together. Its whole life runs on one thread (`EngineThread`),
which calls, in a loop: `add` for each new sequence (built by `new_sequence`), then `step`.
A step advances every running sequence by one forward pass and returns an `EngineOutput` for
each sequence that has something new; a sequence's last output carries its `finish_reason`.
What a request asks comes as the neutral `GenerationOptions`: the engine makes its own
parameters of them (`params`) and says what it cannot take (`problem`), so its users plan a
request without knowing which kind of engine decodes it.
Nothing else touches an engine, so none of this is thread-safe, and none of it needs to be
(the counters below are read from other threads as snapshots, for admission and metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from cdlm_serve.engine.decoding.dlm_sequence import DLMParams
    from cdlm_serve.engine.decoding.grammar import Grammars
    from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
    from cdlm_serve.engine.decoding.request import GenerationOptions
    from cdlm_serve.engine.decoding.sampling import SamplingParams
    from cdlm_serve.engine.decoding.work_queue import WorkQueue
    from cdlm_serve.engine.limits import LimitProblem
    from cdlm_serve.engine.sessions import Session

FinishReason = Literal["stop", "length", "abort"]
# An engine's request parameters: SamplingParams (autoregressive), DLMParams (diffusion); the
# engine makes them (`params`) and takes them (`new_sequence`), so P is invariant.
P = TypeVar("P", bound="SamplingParams | DLMParams")
# An engine's sequence: ARSequence, DLMSequence (what `new_sequence` makes and `add` takes).
S = TypeVar("S")


@dataclass(slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives (token, logprob), best first


@dataclass(slots=True)
class EngineOutput:
    """What one step adds to one request's answer."""

    request_id: str
    token_ids: list[int]  # newly final tokens (counted as generated, stop tokens included)
    text: str  # their text, stop strings cut, held-back characters released later
    finish_reason: FinishReason | None = None  # set on the request's last output only
    # Autoregressive engines, when the request asked for logprobs: one per token_ids entry.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Diffusion engines: forward passes (denoising steps) the request has taken so far.
    steps: int | None = None
    # Autoregressive engines, on a request's last output: prompt tokens the prefix cache gave.
    cached_tokens: int | None = None
    # Autoregressive engines, on a request's first output when it asked for prompt logprobs:
    # one per prompt token after the first (nothing predicts the first).
    prompt_logprobs: list[TokenLogprob] | None = None


class Engine(Protocol[P, S]):
    """Both engines, as the server and the engine thread see them: AREngine is an
    Engine[SamplingParams, ARSequence], DLMEngine an Engine[DLMParams, DLMSequence]."""

    max_model_len: int
    # Automatic prefix caching, where the engine has it (None: off, or not this kind of engine).
    prefix_cache: PrefixCache | None
    grammars: Grammars  # structured outputs: the model's compiled grammars

    def params(self, options: GenerationOptions, max_tokens: int, seed: int | None) -> P:
        """This engine's parameters for a request's options, with the engine's defaults where
        the request asks for none: an answer of at most `max_tokens`, drawn with `seed`.
        LimitError for options that cannot go together."""
        ...

    def problem(self, prompt: int, params: P, history: int = 0) -> LimitProblem | None:
        """Why a prompt of `prompt` tokens, after `history` tokens of a session's, cannot be
        decoded with `params` (`new_sequence` refuses it), or None."""
        ...

    @property
    def work(self) -> WorkQueue:
        """Model work that is not a sequence, run between the steps (`engine.decoding.
        work_queue.WorkQueue` says what runs when)."""
        ...

    def new_sequence(
        self,
        request_id: str,
        prompt: list[int],
        params: P,
        aborted: Callable[[], bool] = ...,
        session: Session | None = None,
        append: bool = True,
    ) -> S:
        """A sequence for `add`; ValueError when the engine cannot take the request (too long
        for the context, an option it does not support). `aborted()` is polled every step: a
        request whose client went away leaves with finish_reason "abort". With a session,
        the sequence continues from its cache (and, with `append`, writes back into it)."""
        ...

    def add(self, seq: S) -> None:
        """Queue a sequence; it starts decoding at a coming step."""
        ...

    def step(self) -> list[EngineOutput]:
        """One forward pass for everything running (admitting waiting sequences first)."""
        ...

    def has_work(self) -> bool: ...

    def reset(self) -> None:
        """Drop every sequence (after a failed step, whose state cannot be trusted)."""
        ...

    def num_waiting(self) -> int:
        """Sequences queued but not yet decoding."""
        ...

    def num_running(self) -> int: ...

    def kv_usage(self) -> float:
        """Fraction of the allocated KV-cache slots holding committed tokens, in [0, 1]."""
        ...

    def kv_bytes(self) -> int:
        """Bytes the engine's batch KV caches take (every row and slot allocated)."""
        ...

    def release_idle(self) -> None:
        """Nothing runs or waits (the engine thread has been idle a while): let go of the
        batch caches, built again by the next request."""
        ...
