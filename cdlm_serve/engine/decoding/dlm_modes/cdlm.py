"""cdlm (a block-causal student): the prompt is prefilled once into a KV cache; a step runs only
the current block against the cache (bidirectional inside the block, causal to the past). A
finished block's K/V is committed exactly by folding it into the next block's first pass: that
pass runs [finished block, next block], and the block-causal mask keeps the finished block from
seeing the new one, so its K/V are what a separate pass would give."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.engine.decoding.dlm_modes.base import (
    DecodeContext,
    DecodingMode,
    block_causal,
    cached_forward,
    fused_forward,
    fused_stack,
)
from cdlm_serve.engine.decoding.dlm_modes.registry import register
from cdlm_serve.engine.decoding.dlm_sequence import BlockPass, DLMSequence


@dataclass(slots=True)
class CdlmState:
    commit_previous_block: bool = False  # the previous block is final, not yet cached


class Cdlm(DecodingMode):
    name = "cdlm"

    def new_state(self) -> CdlmState:
        return CdlmState()

    def admit(self, ctx: DecodeContext, seqs: list[DLMSequence]) -> None:
        """Prefill the new sequences' prompts (each one bidirectional block) into their cache
        rows, all in one forward."""
        runner, device = ctx.runner, ctx.runner.device
        needed = max(len(s.prompt) + s.gen_len + 2 * s.block_size for s in seqs)
        cache = ctx.cache(self.name, needed)
        stack = runner.invariant_stack()
        if stack is not None:
            _admit_fused(ctx, stack, seqs)
            return
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(seqs), width, dtype=torch.bool, device=device)
        for i, s in enumerate(seqs):
            cache.reset(s.row)
            ids[i, : len(s.prompt)] = s.tokens[: len(s.prompt)]
            valid[i, : len(s.prompt)] = True
        ragged = any(len(s.prompt) != width for s in seqs)
        first = seqs[0].row  # admitted together: consecutive rows
        hidden = runner.forward(
            ids,
            cache=cache,
            rows=(first, first + len(seqs)),
            pattern=block_causal(seqs, device),
            valid=valid if ragged else None,
        )  # [n, W, hidden]
        ctx.count_forward()
        for i, s in enumerate(seqs):
            s.steps += 1  # reported steps are forward passes, the prefill included
            if ctx.shift:
                s.first_logits = runner.logits(hidden[i, len(s.prompt) - 1]).float()

    def plan(self, seq: DLMSequence) -> BlockPass:
        size, start = seq.block_size, len(seq.prompt) + seq.block_start
        if seq.state.commit_previous_block:  # [finished block, current block]: adjacent
            return BlockPass(seq, seq.tokens[start - size : start + size], size, size)
        return BlockPass(seq, seq.tokens[start : start + size], 0, 0)

    def forward(self, ctx: DecodeContext, passes: list[BlockPass]) -> Tensor:
        cache = ctx.cache(self.name, 0)
        stack = fused_stack(passes, ctx)
        if stack is not None:
            return fused_forward(ctx, stack, passes, cache, _block_causal_reach)
        pattern = block_causal([p.seq for p in passes], ctx.runner.device)
        return cached_forward(ctx, self.name, passes, pattern)

    def after_pass(self, seq: DLMSequence) -> None:
        seq.state.commit_previous_block = False

    def next_block(self, seq: DLMSequence) -> None:
        seq.state.commit_previous_block = True


def _admit_fused(ctx: DecodeContext, stack: Any, seqs: list[DLMSequence]) -> None:
    """`Cdlm.admit` in batch-invariant mode: each prompt alone through the fused step, one
    bidirectional block (every prompt token sees the whole prompt), so its K/V are the same
    bits whoever was admitted with it."""
    runner, cache = ctx.runner, ctx.cache(Cdlm.name, 0)
    for s in seqs:
        cache.reset(s.row)
        n = len(s.prompt)
        ids = s.tokens[:n].tolist()
        hidden = runner.fused_tokens(stack, ids, [s.row] * n, range(n), [n] * n, cache)  # [n, h]
        counts = [0] * cache.batch
        counts[s.row] = n
        cache.commit(counts)
        ctx.count_forward()
        s.steps += 1  # reported steps are forward passes, the prefill included
        if ctx.shift:
            s.first_logits = runner.logits(hidden[n - 1]).float()


def _block_causal_reach(p: BlockPass, base: int, n: int) -> list[int]:
    """A pass's tokens (the block just completed, then the current one; or the current one
    alone) each see the row's committed slots and their own block, bidirectionally."""
    size = p.seq.block_size
    return [base + min(n, (j // size + 1) * size) for j in range(n)]


register(Cdlm())
