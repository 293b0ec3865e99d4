"""Ring buffers for sliding-window layers: a row keeps the K/V of its last positions only.

A sliding-window layer (Gemma 3's local layers) lets a token see the `window` positions up to
its own, itself included. Its cache holds R >= window slots per row, position p at slot p % R,
so it never grows with the sequence: its memory is bounded by the window however long the
session. A forward of Q new tokens writes them at their slots before attending; R >= window +
Q - 1 keeps every position a new query needs (the window - 1 before the first, then the new
ones) while older ones are overwritten, whether the forward commits or not (the ring grows to
that for a long forward, and `trim` shrinks it back to the window).

Positions, not physical slots, index it: the parent cache's logical length of a row says which
position each slot holds (`positions`). So compacting the global layers, which changes their
slots but not the positions, leaves the ring valid, and a forward that commits nothing (a
reference pass) overwrites only positions no later query needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

RING_STEP = 64  # a grown ring's size is a multiple of this


@dataclass(slots=True)
class WindowCache:
    keys: list[Tensor]  # per sliding-window layer [B, Hkv, R, D]
    values: list[Tensor]  # per sliding-window layer [B, Hkv, R, D]
    window: int

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> WindowCache:
        shape = (batch, num_kv_heads, window, head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)],
            window=window,
        )

    @property
    def ring(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def held(self, logical: int) -> int:
        """How many of a row's last positions (of logical length `logical`) any later query
        can see: window - 1 (the window ends at the query itself). What copies keep."""
        return min(logical, self.window - 1, self.ring)

    # ---- the forward pass ------------------------------------------------------------------
    def ensure(self, q_len: int, logical: list[int]) -> None:
        """Room for a forward of q_len new tokens: window + q_len - 1 slots (each new query's
        window must survive the new tokens' writes)."""
        needed = self.window + q_len - 1
        if needed > self.ring:
            # Rounded up (a prompt's chunks vary a little), not doubled: a ring is grown for a
            # longer forward, not for a sequence that keeps growing.
            self._relayout(-(-needed // RING_STEP) * RING_STEP, logical)

    def write(
        self, layer: int, k_new: Tensor, v_new: Tensor, starts: list[int]
    ) -> tuple[Tensor, Tensor]:
        """Write Q new tokens' K/V (k_new, v_new [B, Hkv, Q, D]), row b's at positions
        [starts[b], starts[b] + Q), and return the whole ring [B, Hkv, R, D] to attend to
        (under `mask`)."""
        ring, q_len = self.ring, k_new.shape[2]
        k_buf, v_buf = self.keys[layer], self.values[layer]
        first = starts[0] % ring
        if all(s == starts[0] for s in starts) and first + q_len <= ring:
            k_buf[:, :, first : first + q_len] = k_new
            v_buf[:, :, first : first + q_len] = v_new
        else:
            device = k_new.device
            slots = (
                torch.tensor(starts, device=device)[:, None] + torch.arange(q_len, device=device)
            ) % ring  # [B, Q]
            rows = torch.arange(len(starts), device=device)[:, None].expand_as(slots)
            # Advanced indices around a slice put the indexed dims first: [B, Q, Hkv, D].
            k_buf[rows, :, slots] = k_new.transpose(1, 2)
            v_buf[rows, :, slots] = v_new.transpose(1, 2)
        return k_buf, v_buf

    def positions(self, ends: Tensor) -> Tensor:
        """ends [B] (each row's last written position) -> [B, R]: the position each slot
        holds (negative: never written)."""
        slots = torch.arange(self.ring, device=ends.device)[None, :]  # [1, R]
        return ends[:, None] - torch.remainder(ends[:, None] - slots, self.ring)

    def mask(self, q_pos: Tensor, starts: list[int], q_len: int) -> Tensor:
        """bool [B, 1, Q, R]: which slots the new tokens (positions q_pos [B, Q], written at
        [starts[b], starts[b] + q_len)) see: the positions within the window up to their own."""
        ends = torch.tensor(starts, device=q_pos.device) + (q_len - 1)  # [B]
        held = self.positions(ends)[:, None, :]  # [B, 1, R]
        q = q_pos[:, :, None]  # [B, Q, 1]
        visible = (held >= 0) & (held <= q) & (held > q - self.window)  # [B, Q, R]
        return visible[:, None]

    # ---- rows ------------------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> WindowCache:
        """Rows [start, stop) as a cache of their own (same storage)."""
        return WindowCache(
            [k[start:stop] for k in self.keys], [v[start:stop] for v in self.values], self.window
        )

    def extract_row(self, row: int, logical: int) -> WindowCache:
        """A batch-1 copy of one row (of logical length `logical`), its ring the window."""
        out = WindowCache.allocate(
            len(self.keys), 1, *self._head_shape(), self.window, *self._where()
        )
        out.load_row(0, self, row, logical)
        return out

    def load_row(self, row: int, src: WindowCache, src_row: int, logical: int) -> None:
        """Copy the positions another cache's row holds (logical length `logical`) into
        `row`, which takes that logical length."""
        count = min(src.held(logical), self.ring)
        if count == 0:
            return
        device = self.keys[0].device
        pos = torch.arange(logical - count, logical, device=device)
        src_slots, dst_slots = pos % src.ring, pos % self.ring
        for buffers, sources in ((self.keys, src.keys), (self.values, src.values)):
            for buf, source in zip(buffers, sources, strict=True):
                buf[row][:, dst_slots] = source[src_row][:, src_slots.to(source.device)].to(
                    device=buf.device, dtype=buf.dtype
                )

    def move_row(self, src: int, dst: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst] = buf[src]

    def trim(self, logical: list[int]) -> None:
        """Give back what a long forward grew the ring to: back to the window."""
        if self.ring > self.window:
            self._relayout(self.window, logical)

    # ---- segments (a session's files) -----------------------------------------------------
    def ordered(self, row: int, logical: int) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer, the K/V [Hkv, n, D] of the last n = `held(logical)` positions of one
        row, oldest first: what a session's segment keeps of these layers."""
        count = self.held(logical)
        pos = torch.arange(logical - count, logical, device=self.keys[0].device) % self.ring
        return [k[row][:, pos] for k in self.keys], [v[row][:, pos] for v in self.values]

    @classmethod
    def from_ordered(
        cls, keys: list[Tensor], values: list[Tensor], window: int, logical: int
    ) -> WindowCache:
        """A batch-1 cache from `ordered`'s tensors (the last positions up to `logical`)."""
        count = keys[0].shape[1]
        shape = (1, keys[0].shape[0], window, keys[0].shape[2])
        device, dtype = keys[0].device, keys[0].dtype
        out = cls(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in keys],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in values],
            window,
        )
        slots = torch.arange(logical - count, logical, device=device) % window
        for buf, part in zip((*out.keys, *out.values), (*keys, *values), strict=True):
            buf[0][:, slots] = part
        return out

    # ---- helpers ----------------------------------------------------------------------------
    def _relayout(self, size: int, logical: list[int]) -> None:
        """A ring of `size` slots holding the same positions (as many of the last as fit)."""
        old = WindowCache(self.keys, self.values, self.window)
        batch = self.batch
        self.keys = [k.new_zeros(batch, k.shape[1], size, k.shape[3]) for k in old.keys]
        self.values = [v.new_zeros(batch, v.shape[1], size, v.shape[3]) for v in old.values]
        for row in range(batch):
            self.load_row(row, old, row, logical[row])

    def _head_shape(self) -> tuple[int, int]:
        return self.keys[0].shape[1], self.keys[0].shape[3]

    def _where(self) -> tuple[torch.device, torch.dtype]:
        return self.keys[0].device, self.keys[0].dtype
