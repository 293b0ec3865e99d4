"""Attention patterns as data, and the masks they become.

A pattern says which key a query may see, in terms of the *logical* sequence index of both
(their RoPE positions). Three patterns cover everything we serve:

- causal: an AR model; key k is visible to query q iff k <= q.
- bidirectional: a diffusion LM (Dream, LLaDA); everything is visible.
- block_causal: a CDLM student; the sequence is cut into blocks of `block_size` starting at
  `block_start` (everything before it -- the prompt -- is one block); a query sees its own
  block fully and every earlier block.

Keys already committed to a KV cache always lie in the past of every new query, so they are
visible under every pattern; only the keys of the tokens in the current forward need the
pattern. The mask built here is boolean; per-key additive biases (Attention Matching's beta on
compacted slots) are folded in per layer by `with_key_bias`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

PatternKind = Literal["causal", "bidirectional", "block_causal"]


@dataclass(frozen=True, slots=True)
class AttentionPattern:
    kind: PatternKind
    # Block size: an int for the whole batch or an int64 tensor [B] per sequence.
    block_size: int | Tensor = 0
    # Logical index where the first block starts: an int for the whole batch or an int64
    # tensor [B] per sequence (prompts of different lengths).
    block_start: int | Tensor = 0

    def __post_init__(self) -> None:
        size = self.block_size
        too_small = bool((size < 1).any()) if isinstance(size, Tensor) else size < 1
        if self.kind == "block_causal" and too_small:
            raise ValueError("block_causal attention needs block_size >= 1")

    @staticmethod
    def causal() -> AttentionPattern:
        return AttentionPattern("causal")

    @staticmethod
    def bidirectional() -> AttentionPattern:
        return AttentionPattern("bidirectional")

    @staticmethod
    def block_causal(block_size: int | Tensor, block_start: int | Tensor = 0) -> AttentionPattern:
        return AttentionPattern("block_causal", block_size, block_start)

    def block_index(self, pos: Tensor) -> Tensor:
        """pos [B, N] -> block id [B, N]: 0 before block_start, then 1, 2, ... per block."""
        start, size = self.block_start, self.block_size
        if isinstance(start, Tensor):
            start = start.to(pos.device).view(-1, 1)
        if isinstance(size, Tensor):
            size = size.to(pos.device).view(-1, 1)
        rel = pos - start
        return torch.where(rel < 0, 0, torch.div(rel, size, rounding_mode="floor") + 1)

    def allowed(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q_pos [B, Q], k_pos [B, K] -> bool [B, Q, K]: may query q see key k."""
        if self.kind == "bidirectional":
            return torch.ones(
                q_pos.shape[0],
                q_pos.shape[1],
                k_pos.shape[1],
                dtype=torch.bool,
                device=q_pos.device,
            )
        if self.kind == "causal":
            return k_pos[:, None, :] <= q_pos[:, :, None]
        return self.block_index(k_pos)[:, None, :] <= self.block_index(q_pos)[:, :, None]


@dataclass(frozen=True, slots=True)
class Band:
    """Banded attention for a continuation whose new tokens line up with cached slots (a
    compaction's repeat pass: repeated token r is the one cached at slot r).

    The new tokens go in blocks of `rows`. A token of block b (new tokens [b * rows,
    (b + 1) * rows)) sees the cached slots [0, sinks) and those within `window` of the block's
    aligned slots [b * rows + offset, (b + 1) * rows + offset), the first `lead` new tokens
    (the instruction before the repeat), the `window` new tokens before its block and its
    block's tokens causally. So every token sees at least `window` slots either side of its
    own, and a block's tokens all see the same keys bar the causal square: no mask is needed.
    An approximation of the full causal continuation, for reference queries only: attention
    costs O(Q x (window + rows)) instead of O(Q x K)."""

    window: int
    offset: int
    lead: int = 0
    sinks: int = 4
    rows: int = 256

    def cached_ranges(self, block: int, cached: int) -> list[tuple[int, int]]:
        """The cached slot ranges [lo, hi) block `block` sees, disjoint and in order."""
        first = block * self.rows + self.offset
        window = (first - self.window, first + self.rows + self.window)
        return disjoint(((0, self.sinks), window), 0, cached)

    def new_ranges(self, block: int, start: int) -> list[tuple[int, int]]:
        """The new-token ranges that all of block `block`'s tokens from `start` on see
        (before `start`: the lead, the window before the block, the block's tokens before)."""
        window = (block * self.rows - self.window, start)
        return disjoint(((0, self.lead), window), 0, start)

    def blocks(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(block, lo, hi) for each block that new tokens [start, stop) meet: its rows [lo, hi)
        among them, in order."""
        first, last = start // self.rows, (stop - 1) // self.rows
        return [
            (b, max(start, b * self.rows), min(stop, (b + 1) * self.rows))
            for b in range(first, last + 1)
        ]

    def key_ranges(self, block: int, start: int, cached: int) -> list[tuple[int, int]]:
        """What all of block `block`'s new tokens from `start` on see, as key indices of a
        continuation of `cached` slots (the cached ranges, then the new tokens' before
        `start`), disjoint and in order."""
        new = [(cached + a, cached + b) for a, b in self.new_ranges(block, start)]
        return self.cached_ranges(block, cached) + new

    def visible(
        self, start: int, stop: int, q_len: int, key_len: int, device: torch.device
    ) -> Tensor:
        """bool [stop - start, key_len]: which keys new tokens [start, stop) of Q = q_len see
        (the keys end with the new tokens)."""
        cached = key_len - q_len
        i = torch.arange(start, stop, device=device)[:, None]  # [c, 1]
        first = torch.div(i, self.rows, rounding_mode="floor") * self.rows  # block starts
        slot = torch.arange(key_len, device=device)[None, :]  # [1, K]
        near = (slot >= first + self.offset - self.window) & (
            slot < first + self.rows + self.offset + self.window
        )
        in_cache = (slot < self.sinks) | near
        new = slot - cached  # the new-token index of slots >= cached
        in_new = ((new < self.lead) | (new >= first - self.window)) & (new <= i)
        return torch.where(slot < cached, in_cache, in_new)


def reread_mask(slots: Tensor, cached: int) -> AttentionMask:
    """The mask of new tokens that are cached ones read again (new token i is the one cached
    at slot slots[i], slots [Q] int64, ascending): each sees the cached slots up to its own
    (its own key as cached) and no new token, just as when the row was prefilled. So a few of
    a row's tokens can be run through the model again, each getting the very queries it had at
    prefill (a compaction's sample of the context's own queries), at the cost of those tokens
    alone. bool [1, 1, Q, cached + Q]; on a CPU the attention runs without it
    (`models.flash_continuation.reread_rows`)."""
    keys = torch.arange(cached + slots.shape[0], device=slots.device)
    visible = keys[None, :] <= slots[:, None]  # [Q, K]: every slot < cached, no new token
    return AttentionMask(visible[None, None], False, visible.shape[1], reread=slots)


def disjoint(ranges: Iterable[tuple[int, int]], first: int, end: int) -> list[tuple[int, int]]:
    """Index ranges [lo, hi) clipped to [first, end), merged where they overlap, in order."""
    clipped = []
    for lo, hi in ranges:
        lo, hi = max(lo, first), min(hi, end)
        if lo < hi:
            clipped.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(clipped):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


@dataclass(slots=True)
class AttentionMask:
    """What every layer's SDPA call needs for one forward.

    `visible` is None when every key in range is visible to every query, or when `is_causal`
    says the rule instead: query i of Q sees keys up to K - Q + i (causal, aligned to the end:
    the cached slots, then the new tokens causally; SDPA's own causal flag when K == Q). Else
    `visible` is bool [B or 1, 1, Q, K].
    """

    visible: Tensor | None
    is_causal: bool
    key_len: int
    band: Band | None = None  # narrows what each query sees further (`Band`)
    reread: Tensor | None = None  # the cached slots the new tokens are (`reread_mask`)

    def rows(self, start: int, stop: int, q_len: int, device: torch.device) -> AttentionMask:
        """The mask of queries [start, stop) of the Q = q_len new tokens (attention computed in
        query chunks), SDPA's causal flag (and the band) turned into an explicit boolean mask:
        query i sees keys up to key_len - q_len + i (the keys end with the new tokens)."""
        if self.visible is not None:
            visible = self.visible[:, :, start:stop]
        elif self.is_causal:
            visible = causal_rows(start, stop, q_len, self.key_len, device)
        elif self.band is None:
            return self
        else:
            visible = torch.ones(1, 1, stop - start, self.key_len, dtype=torch.bool, device=device)
        if self.band is not None:
            visible = visible & self.band.visible(start, stop, q_len, self.key_len, device)
        return AttentionMask(visible, False, self.key_len)


def build_mask(
    pattern: AttentionPattern,
    q_pos: Tensor,
    cached_lens: list[int] | None,
    valid: Tensor | None,
    q_start: int | None = None,
) -> AttentionMask:
    """Mask for Q new tokens (positions q_pos [B, Q]) attending to the cached slots of their row
    plus the new tokens themselves.

    Row b's cache holds cached_lens[b] committed slots; its new tokens are written to slots
    [cached_lens[b], cached_lens[b] + Q). `valid` [B, Q] marks padding among the new tokens
    (padding keys are hidden; every token still sees itself so no softmax row is empty).
    `q_start`, when known on the host, is the position every row's new tokens start at: it
    lets a block-causal step whose tokens form one block skip the mask entirely.
    """
    batch, q_len = q_pos.shape
    lens = cached_lens if cached_lens is not None else [0] * batch
    uniform = all(n == lens[0] for n in lens)
    key_len = max(lens) + q_len
    if uniform and valid is None:
        fast = _uniform_fast_path(pattern, lens[0], q_len, key_len, q_start)
        if fast is not None:
            return fast

    device = q_pos.device
    new_vis = pattern.allowed(q_pos, q_pos)  # [B, Q, Q]
    if valid is not None:
        new_vis = new_vis & valid[:, None, :]
    new_vis = new_vis | torch.eye(q_len, dtype=torch.bool, device=device)
    if uniform:
        # One layout for the whole batch: cached slots are all visible, then the new block.
        cached = torch.ones(batch, q_len, lens[0], dtype=torch.bool, device=device)
        visible = torch.cat([cached, new_vis], dim=-1)
        return AttentionMask(visible.unsqueeze(1), False, key_len)
    # Rows differ in cache length: slot j of row b is cached if j < len_b, else it is new
    # token j - len_b (if that is < Q), else unused.
    slots = torch.arange(key_len, device=device)  # [K]
    lens_t = torch.tensor(lens, device=device).view(batch, 1)  # [B, 1]
    rel = slots.view(1, -1) - lens_t  # [B, K]
    is_cached = rel < 0
    is_new = (rel >= 0) & (rel < q_len)
    gathered = new_vis.gather(2, rel.clamp(0, q_len - 1)[:, None, :].expand(batch, q_len, key_len))
    visible = is_cached[:, None, :] | (gathered & is_new[:, None, :])  # [B, Q, K]
    return AttentionMask(visible.unsqueeze(1), False, key_len)


def causal_rows(start: int, stop: int, q_len: int, key_len: int, device: torch.device) -> Tensor:
    """bool [1, 1, stop - start, key_len]: causal visibility of queries [start, stop) of Q new
    tokens that are the last Q of key_len keys."""
    first = key_len - q_len + start
    q_pos = torch.arange(first, first + stop - start, device=device)
    return (torch.arange(key_len, device=device)[None, :] <= q_pos[:, None])[None, None]


def _uniform_fast_path(
    pattern: AttentionPattern, cached: int, q_len: int, key_len: int, q_start: int | None
) -> AttentionMask | None:
    if pattern.kind == "bidirectional" or q_len == 1:
        # A single query (decode) sees every cached slot and itself under every pattern.
        return AttentionMask(None, False, key_len)
    if pattern.kind == "causal":  # no [Q, K] mask: chunks of it are made where needed
        return AttentionMask(None, True, key_len)
    if (
        pattern.kind == "block_causal"
        and q_start is not None
        and _one_block(pattern, q_start, q_len)
    ):
        # A CDLM step on one block: its tokens see each other and every cached slot.
        return AttentionMask(None, False, key_len)
    return None


def _one_block(pattern: AttentionPattern, start: int, q_len: int) -> bool:
    size, first = pattern.block_size, pattern.block_start
    if isinstance(size, Tensor) or isinstance(first, Tensor):
        return False  # per-row blocks: deciding would need the device; take the general path

    def block(i: int) -> int:
        return 0 if i < first else 1 + (i - first) // size

    return block(start) == block(start + q_len - 1)


def with_key_bias(
    mask: AttentionMask, bias: Tensor, q_len: int, num_heads: int, dtype: torch.dtype
) -> Tensor:
    """Fold per-key additive biases into a float mask for one layer.

    bias [B, Hkv, K] (0 on ordinary slots, beta on compacted ones) -> float [B, H, Q, K] with
    -inf where the boolean mask hides a key. The query heads of a GQA group share their KV
    head's bias.
    """
    batch, kv_heads, key_len = bias.shape
    group = num_heads // kv_heads
    per_head = bias.to(dtype).repeat_interleave(group, dim=1)[:, :, None, :]  # [B, H, 1, K]
    full = per_head.expand(batch, num_heads, q_len, key_len)
    if mask.visible is not None:
        return full.masked_fill(~mask.visible, float("-inf"))
    if mask.is_causal:
        causal = torch.ones(q_len, key_len, dtype=torch.bool, device=bias.device).tril(
            key_len - q_len
        )
        return full.masked_fill(~causal, float("-inf"))
    return full.contiguous()
