"""What a decoding mode of the diffusion engine decides; `DLMEngine` does everything else
(admission, batching per mode, choosing which masked tokens a step finalizes, text)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.dlm_sequence import BlockPass, DLMSequence
from models.attention import AttentionPattern

if TYPE_CHECKING:
    from engine.dlm_engine import DLMEngine


class DecodingMode:
    """One way to decode: what a sequence's next pass runs, how a batch of passes runs (one
    forward), and what changes after a pass and at a block's end. A new mode is one subclass
    in one file, registered in `engine.dlm_modes.MODES`."""

    name: str
    parallel = True  # finalize every masked token above the threshold (else one per step)

    def admit(self, engine: DLMEngine, seqs: list[DLMSequence]) -> None:
        """Sequences that just joined this mode's batch (rows consecutive), before their
        first pass."""

    def plan(self, seq: DLMSequence) -> BlockPass:
        """What the sequence runs in the next forward pass."""
        raise NotImplementedError

    def forward(self, engine: DLMEngine, passes: list[BlockPass]) -> Tensor:
        """All passes of the batch in one forward -> hidden [n, Qmax, hidden]."""
        raise NotImplementedError

    def after_pass(self, seq: DLMSequence) -> None:
        """The sequence's pass ran."""

    def next_block(self, seq: DLMSequence) -> None:
        """The sequence's block is complete; the next pass starts the next block."""


def padded_tokens(engine: DLMEngine, passes: list[BlockPass]) -> tuple[Tensor, Tensor | None]:
    """The passes' tokens right-padded with the mask id [n, Qmax], and which are real [n, Qmax]
    (None when none is padding)."""
    device = engine.model.device
    n, q_max = len(passes), max(p.tokens.shape[0] for p in passes)
    tokens = torch.full((n, q_max), engine.mask_id, dtype=torch.long, device=device)
    valid = torch.zeros(n, q_max, dtype=torch.bool, device=device)
    for i, p in enumerate(passes):
        tokens[i, : p.tokens.shape[0]] = p.tokens
        valid[i, : p.tokens.shape[0]] = True
    return tokens, None if bool(valid.all()) else valid


def cached_forward(
    engine: DLMEngine, mode: str, passes: list[BlockPass], pattern: AttentionPattern
) -> Tensor:
    """The passes on rows 0..n-1 of the mode's cache, one padded forward; each row commits its
    pass's `commit` first tokens (and writes Qmax scratch slots, its padding too)."""
    device, n = engine.model.device, len(passes)
    tokens, valid = padded_tokens(engine, passes)
    cache = engine.cache_for(mode, 0)
    positions = torch.tensor(cache.logical[:n], device=device).view(n, 1) + torch.arange(
        tokens.shape[1], device=device
    )
    return engine.model(
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
