"""fast_dllm (Fast-dLLM's prefix cache, for a bidirectional model): the sequence is prompt plus
the whole masked answer; at each block start one full pass refreshes the cache of everything
before the block; later steps run [current block .. end] against that (approximate) cache.
Threshold decoding, like cdlm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cdlm_serve.engine.decoding.dlm_modes.base import (
    DecodeContext,
    DecodingMode,
    bidirectional_reach,
    cached_forward,
    fused_forward,
    fused_stack,
)
from cdlm_serve.engine.decoding.dlm_modes.registry import register
from cdlm_serve.engine.decoding.dlm_sequence import BlockPass, DLMSequence
from cdlm_serve.models.attention import AttentionPattern


@dataclass(slots=True)
class FastDllmState:
    refresh: bool = True  # the next pass is a full refresh of the cache


class FastDllm(DecodingMode):
    name = "fast_dllm"

    def new_state(self) -> FastDllmState:
        return FastDllmState()

    def plan(self, seq: DLMSequence) -> BlockPass:
        p = len(seq.prompt)
        full = seq.tokens
        if not seq.state.refresh:
            return BlockPass(seq, full[p + seq.block_start :], 0, 0)
        # A refresh: the whole sequence, committing everything before the current block.
        return BlockPass(seq, full, p + seq.block_start, p + seq.block_start)

    def forward(self, ctx: DecodeContext, passes: list[BlockPass]) -> Tensor:
        cache = ctx.cache(self.name, 0)
        for p in passes:
            if p.seq.state.refresh:
                cache.reset(p.seq.row)
        stack = fused_stack(passes, ctx)
        if stack is not None:
            return fused_forward(ctx, stack, passes, cache, bidirectional_reach)
        return cached_forward(ctx, self.name, passes, AttentionPattern.bidirectional())

    def after_pass(self, seq: DLMSequence) -> None:
        seq.state.refresh = False

    def next_block(self, seq: DLMSequence) -> None:
        seq.state.refresh = True

    def forced_choice(
        self, ctx: DecodeContext, seq: DLMSequence, masked: Tensor, step: int
    ) -> Tensor | None:
        if ctx.schedule == "dream" and step == 0:
            # Fast-dLLM's Dream decoder: a block's first pass (the full refresh) finalizes its
            # first position alone, whatever the confidences; the later passes decide the rest.
            return torch.arange(masked.shape[0], device=masked.device) == 0
        return None


register(FastDllm())
