"""cdlm (a block-causal student): the prompt is prefilled once into a KV cache; a step runs only
the current block against the cache (bidirectional inside the block, causal to the past). A
finished block's K/V is committed exactly by folding it into the next block's first pass: that
pass runs [finished block, next block], and the block-causal mask keeps the finished block from
seeing the new one, so its K/V are what a separate pass would give."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.dlm_modes.base import DecodingMode, block_causal, cached_forward
from engine.dlm_sequence import BlockPass, DLMSequence
from models.kv_cache import KVCache

if TYPE_CHECKING:
    from engine.dlm_engine import DLMEngine

# cdlm steps of up to this many tokens (all rows together) run through the fused C++ step.
# vanilla and fast_dllm steps (whole sequences, or a block plus every later position) stay on
# the PyTorch path: the fused attention is a plain per-query loop, and at 320 tokens it made a
# 256-token vanilla generation of the shipped teacher 1.7x slower (7.0 vs 4.1 s, bf16).
FUSED_BLOCK_TOKENS = 128


class Cdlm(DecodingMode):
    name = "cdlm"

    def admit(self, engine: DLMEngine, seqs: list[DLMSequence]) -> None:
        """Prefill the new sequences' prompts (each one bidirectional block) into their cache
        rows, all in one forward."""
        model, device = engine.model, engine.model.device
        needed = max(len(s.prompt) + s.gen_len + 2 * s.block_size for s in seqs)
        cache = engine.cache_for(self.name, needed)
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(seqs), width, dtype=torch.bool, device=device)
        for i, s in enumerate(seqs):
            cache.reset(s.row)
            ids[i, : len(s.prompt)] = torch.tensor(s.prompt, device=device)
            valid[i, : len(s.prompt)] = True
        ragged = any(len(s.prompt) != width for s in seqs)
        first = seqs[0].row  # admitted together: consecutive rows
        hidden = model(
            ids,
            cache=cache,
            rows=(first, first + len(seqs)),
            pattern=block_causal(seqs, device),
            valid=valid if ragged else None,
        )  # [n, W, hidden]
        engine.forward_passes += 1
        for i, s in enumerate(seqs):
            s.steps += 1  # reported steps are forward passes, the prefill included
            if engine.shift:
                s.first_logits = model.logits(hidden[i, len(s.prompt) - 1]).float()

    def plan(self, seq: DLMSequence) -> BlockPass:
        size, start = seq.block_size, seq.block_start
        block = seq.answer[start : start + size]
        if seq.commit_previous_block:
            done = seq.answer[start - size : start]
            return BlockPass(seq, torch.cat([done, block]), size, size)
        return BlockPass(seq, block, 0, 0)

    def forward(self, engine: DLMEngine, passes: list[BlockPass]) -> Tensor:
        cache = engine.cache_for(self.name, 0)
        if sum(p.tokens.shape[0] for p in passes) <= FUSED_BLOCK_TOKENS:
            fused = self._fused(engine, passes, cache)
            if fused is not None:
                return fused
        pattern = block_causal([p.seq for p in passes], engine.model.device)
        return cached_forward(engine, self.name, passes, pattern)

    def after_pass(self, seq: DLMSequence) -> None:
        seq.commit_previous_block = False

    def next_block(self, seq: DLMSequence) -> None:
        seq.commit_previous_block = True

    @staticmethod
    def _fused(engine: DLMEngine, passes: list[BlockPass], cache: KVCache) -> Tensor | None:
        """The passes through the fused C++ step (bf16 on CPU): each row's new tokens (the
        block just completed, to commit, then the current one; or the current one alone) are
        block-causal, so every token attends to its row's committed slots and its own block,
        bidirectionally. Returns hidden [n, Qmax, hidden] like the padded forward (padding
        rows zero), or None where the fused kernels do not apply."""
        ids: list[int] = []
        owners: list[int] = []
        slots: list[int] = []
        attend: list[int] = []
        for p in passes:
            row, size, n = p.seq.row, p.seq.block_size, p.tokens.shape[0]
            base = cache.lengths[row]
            ids += p.tokens.tolist()
            owners += [row] * n
            slots += range(base, base + n)
            attend += [base + min(n, (j // size + 1) * size) for j in range(n)]
        flat = engine.model.fused_tokens(ids, owners, slots, attend, cache)  # [T, hidden]
        if flat is None:
            return None
        q_max = max(p.tokens.shape[0] for p in passes)
        hidden = flat.new_zeros(len(passes), q_max, flat.shape[-1])
        start = 0
        for i, p in enumerate(passes):
            n = p.tokens.shape[0]
            hidden[i, :n] = flat[start : start + n]
            start += n
        counts = [0] * cache.batch
        for p in passes:
            counts[p.seq.row] = p.commit
        cache.commit(counts)
        return hidden
