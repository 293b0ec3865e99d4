"""Structured outputs for diffusion decoding: a block commits only tokens its grammar allows, in
the order the grammar checks them (llguidance's matcher reads an answer left to right).

A row that follows a grammar keeps a *checked* prefix of its answer: every position before
`DLMSequence.grammar_checked` is final and consumed by the row's matcher, and the position there
(the *frontier*) is the answer's first masked one. At each step:

- the frontier's logits are masked to the tokens the grammar allows next, and the stop tokens
  where the grammar may end (`frontier_masks`: the masks of a batch's rows filled together), so
  the token decoded there is always one the grammar accepts;
- the step finalizes positions as it does without a grammar (the threshold, a schedule, at
  least the most confident one): positions right of the frontier are still decoded in parallel,
  unchecked (`GrammarOrder` "any"; "leftmost" keeps only the run that starts at the frontier);
- then `check` feeds the matcher the run of final positions from the frontier up to the first
  masked one: the first token it refuses is masked again (it is then the frontier, decoded next
  under the mask) and, under "any", the final tokens after it stay, checked when the run reaches
  them. A stop token ends the answer where the grammar may end, and is refused where it may
  not; a grammar that is complete (nothing may follow) ends the answer after its last token.

Every mode commits a block's K/V only once the block is complete, and a block completes only
when all its positions are checked, so masking a position again keeps the KV reuse exact. A
position is refused at most once (then it is the frontier), so a block takes at most twice its
size in steps. A row without a grammar runs none of this.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from cdlm_serve.engine.decoding.dlm_sequence import DLMSequence
from cdlm_serve.engine.decoding.grammar import allowed_tokens

# Which positions a step may finalize under a grammar: "any" (as without one; the unchecked
# ones wait for the check) or "leftmost" (only the run that starts at the frontier, which always
# joins it; a refused token takes the rest of the run with it).
GrammarOrder = Literal["any", "leftmost"]


def ruled(seq: DLMSequence) -> bool:
    """The sequence follows a grammar that has not ended its answer yet."""
    return seq.params.grammar is not None and seq.grammar_end is None


def frontier_masks(seqs: list[DLMSequence], vocab: int, device: torch.device) -> dict[int, Tensor]:
    """The tokens allowed at the frontier [V] bool, per index in `seqs` of those that follow a
    grammar (none: an empty dict, and nothing computed)."""
    rows = [i for i, seq in enumerate(seqs) if ruled(seq)]
    if not rows:
        return {}
    allowed = allowed_tokens([seqs[i].params.grammar for i in rows], vocab, device)  # [k, V]
    for k, i in enumerate(rows):
        seq, matcher = seqs[i], _matcher(seqs[i])
        if seq.stop_ids and matcher.is_accepting():  # the answer may end here
            allowed[k, sorted(seq.stop_ids)] = True
    return {i: allowed[k] for k, i in enumerate(rows)}


def leftmost_run(chosen: Tensor, frontier: int) -> Tensor:
    """chosen [B] bool -> the frontier (block index) and the chosen positions right after it
    without a gap ("leftmost" order)."""
    run = chosen.clone()
    run[frontier] = True
    out = torch.zeros_like(chosen)
    out[frontier:] = torch.cumprod(run[frontier:].to(torch.int32), 0).bool()
    return out


def check(seq: DLMSequence, mask_id: int, limit: int, order: GrammarOrder) -> int:
    """Feed the matcher the final run from the frontier (the answer's first `limit` positions);
    mask the first token it refuses again (under "leftmost", the run's rest too); set
    `grammar_end` where the answer ends. Returns how many positions were masked again."""
    matcher, answer, start = _matcher(seq), seq.answer, seq.grammar_checked
    run = answer[start:limit].tolist()
    run = run[: next((i for i, t in enumerate(run) if t == mask_id), len(run))]
    stop = next((i for i, t in enumerate(run) if t in seq.stop_ids), len(run))
    taken = matcher.try_consume_tokens(run[:stop]) if stop else 0
    seq.grammar_checked = at = start + taken
    if matcher.is_stopped():  # complete: nothing may follow (the tokens after are dropped)
        seq.grammar_end = at
        return 0
    if taken == len(run):
        return 0
    if taken == stop and matcher.is_accepting():  # a stop token where the grammar may end
        seq.grammar_end = at
        return 0
    refused = 1 if order == "any" else len(run) - taken
    answer[at : at + refused] = mask_id
    return refused


def _matcher(seq: DLMSequence) -> Any:
    assert seq.params.grammar is not None, "a sequence without a grammar"
    return seq.params.grammar
