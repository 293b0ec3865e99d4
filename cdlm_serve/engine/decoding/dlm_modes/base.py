"""What a decoding mode of the diffusion engine decides; `DLMEngine` does everything else
(admission, batching per mode, choosing which masked tokens a step finalizes, text).

A mode sees the engine only through a `DecodeContext`: the model runner, the mask id, its own
KV cache, a scratch cache, and a counter of forward passes. It owns its per-sequence state
(`new_state`, kept in `DLMSequence.state`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.engine.decoding.dlm_sequence import BlockPass, DLMSequence
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.engine.decoding.unmasking import Schedule
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.kv_cache import KVCache

# How far each token of a pass sees: (the pass, the row's committed slots, its token count) ->
# one count per token, of the row's slots [0, count) it attends to.
Reach = Callable[[BlockPass, int, int], list[int]]


@dataclass(slots=True)
class DecodeContext:
    """What a mode may use of the engine that runs it."""

    runner: ModelRunner  # the model, and the fused-or-PyTorch choice for a pass
    mask_id: int
    shift: bool  # logits are shifted (Dream): hidden state i - 1 predicts position i
    schedule: Schedule  # the model family's step schedule ("dream" or "llada")
    # cache(mode name, capacity) -> that mode's KV cache (max_batch rows; row i belongs to the
    # mode's running sequence i), grown to at least `capacity` slots.
    cache: Callable[[str, int], KVCache]
    # scratch(capacity) -> max_batch rows for passes that commit nothing (not counted as KV use).
    scratch: Callable[[int], KVCache]
    count_forward: Callable[[], None]  # every model forward a mode runs is counted


class DecodingMode:
    """One way to decode: what a sequence's next pass runs, how a batch of passes runs (one
    forward), and what changes after a pass and at a block's end. A new mode is one subclass
    in one file that calls `engine.decoding.dlm_modes.register` with an instance."""

    name: str
    parallel = True  # finalize every masked token above the threshold (else one per step)

    def new_state(self) -> Any:
        """A new sequence's state in this mode (kept in DLMSequence.state)."""
        return None

    def admit(self, ctx: DecodeContext, seqs: list[DLMSequence]) -> None:
        """Sequences that just joined this mode's batch (rows consecutive), before their
        first pass."""

    def plan(self, seq: DLMSequence) -> BlockPass:
        """What the sequence runs in the next forward pass."""
        raise NotImplementedError

    def forward(self, ctx: DecodeContext, passes: list[BlockPass]) -> Tensor:
        """All passes of the batch in one forward -> hidden [n, Qmax, hidden]."""
        raise NotImplementedError

    def after_pass(self, seq: DLMSequence) -> None:
        """The sequence's pass ran."""

    def next_block(self, seq: DLMSequence) -> None:
        """The sequence's block is complete; the next pass starts the next block."""

    def forced_choice(
        self, ctx: DecodeContext, seq: DLMSequence, masked: Tensor, step: int
    ) -> Tensor | None:
        """Positions [B] bool this step must finalize whatever the confidences (`step` is the
        step's index in its block), or None to let the confidences decide."""
        return None


def padded_tokens(ctx: DecodeContext, passes: list[BlockPass]) -> tuple[Tensor, Tensor | None]:
    """The passes' tokens right-padded with the mask id [n, Qmax], and which are real [n, Qmax]
    (None when none is padding)."""
    device = ctx.runner.device
    n, q_max = len(passes), max(p.tokens.shape[0] for p in passes)
    tokens = torch.full((n, q_max), ctx.mask_id, dtype=torch.long, device=device)
    valid = torch.zeros(n, q_max, dtype=torch.bool, device=device)
    for i, p in enumerate(passes):
        tokens[i, : p.tokens.shape[0]] = p.tokens
        valid[i, : p.tokens.shape[0]] = True
    return tokens, None if bool(valid.all()) else valid


def cached_forward(
    ctx: DecodeContext, mode: str, passes: list[BlockPass], pattern: AttentionPattern
) -> Tensor:
    """The passes on rows 0..n-1 of the mode's cache, one padded forward; each row commits its
    pass's `commit` first tokens (and writes Qmax scratch slots, its padding too)."""
    device, n = ctx.runner.device, len(passes)
    tokens, valid = padded_tokens(ctx, passes)
    cache = ctx.cache(mode, 0)
    positions = torch.tensor(cache.logical[:n], device=device).view(n, 1) + torch.arange(
        tokens.shape[1], device=device
    )
    return ctx.runner.forward(
        tokens,
        cache=cache,
        rows=(0, n),
        positions=positions,
        pattern=pattern,
        valid=valid,
        commit=[p.commit for p in passes],
    )


def block_causal(seqs: list[DLMSequence], device: torch.device) -> AttentionPattern:
    """Each sequence's blocks after its prompt (host ints for one sequence, which lets the
    model skip the mask on a single-block step)."""
    if len(seqs) == 1:
        return AttentionPattern.block_causal(seqs[0].block_size, len(seqs[0].prompt))
    return AttentionPattern.block_causal(
        torch.tensor([s.block_size for s in seqs], device=device),
        torch.tensor([len(s.prompt) for s in seqs], device=device),
    )


def bidirectional_reach(p: BlockPass, base: int, n: int) -> list[int]:
    """Every new token sees the row's committed slots and all the pass's tokens."""
    return [base + n] * n


def fused_stack(passes: list[BlockPass], ctx: DecodeContext) -> Any | None:
    """The fused step for these passes, or None where they take the PyTorch path (no fused
    kernels here, or more than `FUSED_STEP_TOKENS` tokens together)."""
    return ctx.runner.fits_fused_pass(sum(p.tokens.shape[0] for p in passes))


def fused_forward(
    ctx: DecodeContext, stack: Any, passes: list[BlockPass], cache: KVCache, reach: Reach
) -> Tensor:
    """The passes through the fused C++ step (`fused_stack`): pass i's tokens go to row
    passes[i].seq.row after its committed slots, each attending as `reach` says; then each row
    commits its pass's `commit` first tokens. Returns hidden [n, Qmax, hidden] like the padded
    PyTorch forward (padding zero)."""
    ids: list[int] = []
    owners: list[int] = []
    slots: list[int] = []
    attend: list[int] = []
    for p in passes:
        row, n = p.seq.row, p.tokens.shape[0]
        base = cache.lengths[row]
        ids += p.tokens.tolist()
        owners += [row] * n
        slots += range(base, base + n)
        attend += reach(p, base, n)
    flat = ctx.runner.fused_tokens(stack, ids, owners, slots, attend, cache)  # [T, hidden]
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
