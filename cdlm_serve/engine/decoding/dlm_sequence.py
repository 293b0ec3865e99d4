"""A diffusion-LM request as the engine holds it: its parameters, its answer being unmasked
block by block, and one sequence's part of a batched forward pass."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.engine.decoding.sampling import GenerationParams
from cdlm_serve.engine.decoding.text_output import TextAssembler
from cdlm_serve.engine.decoding.unmasking import Confidence

# A decoding mode's name: one of engine.decoding.dlm_modes.MODES (the registry, which may grow).
Decoding = str


@dataclass(slots=True)
class DLMParams(GenerationParams):
    """A diffusion request: GenerationParams (greedy by default here) and how to unmask."""

    temperature: float = 0.0
    decoding: Decoding = "cdlm"
    block_size: int = 32
    threshold: float = 0.9
    # A fixed number of denoising steps (all blocks together) on the model family's schedule
    # (engine.decoding.unmasking.quota) instead of the mode's default: the threshold for cdlm and
    # fast_dllm, one token per step for vanilla.
    steps: int | None = None
    confidence: Confidence = "probability"  # how sure a step is of each masked position
    alg_temp: float = 0.0  # > 0: scheduled positions are drawn by confidence (Dream's alg_temp)
    # The answer follows a grammar: this answer's own llguidance matcher
    # (`engine.decoding.grammar.Grammars.matcher`), advanced over the answer's checked prefix
    # (`engine.decoding.dlm_grammar`).
    grammar: Any | None = None


@dataclass(eq=False, slots=True)
class DLMSequence:
    id: str
    prompt: list[int]
    params: DLMParams
    # [P + gen_len] int64 on the model's device: the prompt, then the answer (the mask id where
    # not yet final). One tensor for the whole step: passes read views of it, no per-step copy.
    tokens: Tensor
    text: TextAssembler
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    block: int = 0  # index of the block being decoded
    steps: int = 0
    block_steps: int = 0  # steps taken in the current block
    row: int = -1  # row in its mode's KV cache (set by the scheduler)
    state: Any = None  # its decoding mode's own per-sequence state (DecodingMode.new_state)
    # [V] logits predicting the current block's first token (Dream: the hidden state before
    # the block predicts it, and a pass over the block alone does not compute that state).
    first_logits: Tensor | None = None
    emitted: int = 0  # answer tokens already handed out
    # A grammar's progress (dlm_grammar): the answer's first `grammar_checked` tokens are final
    # and consumed by the matcher; `grammar_end`, once set, is where the grammar ended the
    # answer (a stop token it accepted there, or nothing: it was complete).
    grammar_checked: int = 0
    grammar_end: int | None = None
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # set by the scheduler
    tokens_per_step: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)  # of the blocks it finished
    aborted: Callable[[], bool] = lambda: False

    @property
    def block_size(self) -> int:
        return self.params.block_size

    @property
    def answer(self) -> Tensor:
        """[gen_len] the answer part of `tokens` (a view: writes go into `tokens`)."""
        return self.tokens[len(self.prompt) :]

    @property
    def gen_len(self) -> int:
        return self.tokens.shape[0] - len(self.prompt)

    @property
    def block_start(self) -> int:
        """Answer index of the current block's first token."""
        return self.block * self.block_size


@dataclass(slots=True)
class BlockPass:
    """One sequence's part of a batched forward pass."""

    seq: DLMSequence
    tokens: Tensor  # [Q] the tokens this pass runs
    commit: int  # how many of them become permanent in the cache
    offset: int  # query index of the current block's first token
