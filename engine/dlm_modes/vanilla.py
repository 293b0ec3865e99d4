"""vanilla (the DLM's own decoding): a full bidirectional pass over prompt plus the whole answer
at every step, no cache, one token per step (steps = answer length)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.dlm_modes.base import DecodingMode, bidirectional_reach, fused_forward, padded_tokens
from engine.dlm_sequence import BlockPass, DLMSequence
from models.attention import AttentionPattern

if TYPE_CHECKING:
    from engine.dlm_engine import DLMEngine


class Vanilla(DecodingMode):
    name = "vanilla"
    parallel = False

    def plan(self, seq: DLMSequence) -> BlockPass:
        offset = len(seq.prompt) + seq.block_start
        full = torch.cat([torch.tensor(seq.prompt, device=seq.answer.device), seq.answer])
        return BlockPass(seq, full, 0, offset)

    def forward(self, engine: DLMEngine, passes: list[BlockPass]) -> Tensor:
        scratch = engine.scratch_cache(max(p.tokens.shape[0] for p in passes))
        fused = fused_forward(engine, passes, scratch, bidirectional_reach)
        if fused is not None:
            return fused
        tokens, valid = padded_tokens(engine, passes)
        return engine.model(tokens, pattern=AttentionPattern.bidirectional(), valid=valid)
