"""What a request asks of decoding, in no wire format's words.

The server reads a request body into one `GenerationOptions` where it enters, and plans with
that alone; each engine turns it into its own parameters (`Engine.params`: `SamplingParams` for
the autoregressive engine, `DLMParams` for the diffusion one), with its own defaults, so the
planner never asks which kind of engine it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cdlm_serve.engine.decoding.grammar import GrammarSpec

# The options only a diffusion engine takes, in the order a refusal names them.
DIFFUSION_OPTIONS = ("decoding", "block_size", "threshold", "steps", "alg", "alg_temp", "remasking")
# The options only the autoregressive engine takes (they change its next-token distribution;
# a diffusion engine commits many tokens a pass, from no one token's distribution). A grammar
# is both engines' (the diffusion engine's: `engine.decoding.dlm_grammar`).
AUTOREGRESSIVE_OPTIONS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_p",
)


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """A request's decoding options. None is "not asked for": the engine's default."""

    # None: the engine's default (the autoregressive engine samples at 1, the diffusion engine
    # decodes greedily unless asked to sample).
    temperature: float | None = None
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # a prompt's first choice's; its choice j draws with seed + j
    n: int = 1  # choices per prompt
    max_tokens: int | None = None  # None: the rest of the context
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (an echoed prompt)
    ignore_eos: bool = False
    cache_salt: str | None = None  # prefix-cache blocks are shared within one salt only
    # The autoregressive engine's (AUTOREGRESSIVE_OPTIONS; `SamplingParams` says what each does).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_p: float | None = None
    # Both engines': the answer's structure (structured outputs).
    grammar: GrammarSpec | None = None
    # The diffusion engine's (DIFFUSION_OPTIONS): its decoding mode, block size and threshold,
    # and the reference releases' own options: a fixed number of steps, Dream's `alg` and
    # `alg_temp`, LLaDA's `remasking` (`alg`'s alternative).
    decoding: str | None = None
    block_size: int | None = None
    threshold: float | None = None
    steps: int | None = None
    alg: str | None = None
    alg_temp: float | None = None
    remasking: str | None = None

    def autoregressive_options(self) -> list[str]:
        """The autoregressive-only options this request sets (a diffusion model refuses them),
        in AUTOREGRESSIVE_OPTIONS' order."""
        return [name for name in AUTOREGRESSIVE_OPTIONS if getattr(self, name) is not None]

    def diffusion_options(self) -> list[str]:
        """The diffusion-only options this request sets (an autoregressive model refuses
        them), in DIFFUSION_OPTIONS' order."""
        return [name for name in DIFFUSION_OPTIONS if getattr(self, name) is not None]
