"""fast_dllm (Fast-dLLM's prefix cache, for a bidirectional model): the sequence is prompt plus
the whole masked answer; at each block start one full pass refreshes the cache of everything
before the block; later steps run [current block .. end] against that (approximate) cache.
Threshold decoding, like cdlm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.dlm_modes.base import (
    DecodingMode,
    bidirectional_reach,
    cached_forward,
    fused_forward,
)
from engine.dlm_sequence import BlockPass, DLMSequence
from models.attention import AttentionPattern

if TYPE_CHECKING:
    from engine.dlm_engine import DLMEngine


class FastDllm(DecodingMode):
    name = "fast_dllm"

    def plan(self, seq: DLMSequence) -> BlockPass:
        p = len(seq.prompt)
        full = torch.cat([torch.tensor(seq.prompt, device=seq.answer.device), seq.answer])
        if not seq.refresh:
            return BlockPass(seq, full[p + seq.block_start :], 0, 0)
        # A refresh: the whole sequence, committing everything before the current block.
        return BlockPass(seq, full, p + seq.block_start, p + seq.block_start)

    def forward(self, engine: DLMEngine, passes: list[BlockPass]) -> Tensor:
        cache = engine.cache_for(self.name, 0)
        for p in passes:
            if p.seq.refresh:
                cache.reset(p.seq.row)
        fused = fused_forward(engine, passes, cache, bidirectional_reach)
        if fused is not None:
            return fused
        return cached_forward(engine, self.name, passes, AttentionPattern.bidirectional())

    def after_pass(self, seq: DLMSequence) -> None:
        seq.refresh = False

    def next_block(self, seq: DLMSequence) -> None:
        seq.refresh = True
