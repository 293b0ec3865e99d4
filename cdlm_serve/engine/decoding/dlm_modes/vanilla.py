"""vanilla (the DLM's own decoding): a full bidirectional pass over prompt plus the whole answer
at every step, no cache, one token per step (steps = answer length)."""

from __future__ import annotations

from torch import Tensor

from cdlm_serve.engine.decoding.dlm_modes.base import (
    DecodeContext,
    DecodingMode,
    bidirectional_reach,
    fused_forward,
    fused_stack,
    padded_tokens,
)
from cdlm_serve.engine.decoding.dlm_modes.registry import register
from cdlm_serve.engine.decoding.dlm_sequence import BlockPass, DLMSequence
from cdlm_serve.models.attention import AttentionPattern


class Vanilla(DecodingMode):
    name = "vanilla"
    parallel = False

    def plan(self, seq: DLMSequence) -> BlockPass:
        offset = len(seq.prompt) + seq.block_start
        return BlockPass(seq, seq.tokens, 0, offset)

    def forward(self, ctx: DecodeContext, passes: list[BlockPass]) -> Tensor:
        stack = fused_stack(passes, ctx)
        if stack is not None:
            scratch = ctx.scratch(max(p.tokens.shape[0] for p in passes))
            return fused_forward(ctx, stack, passes, scratch, bidirectional_reach)
        tokens, valid = padded_tokens(ctx, passes)
        return ctx.runner.forward(tokens, pattern=AttentionPattern.bidirectional(), valid=valid)


register(Vanilla())
