"""A preallocated per-layer KV cache for a batch of sequences.

Layout per layer: keys and values [B, Hkv, S, D] where S is the capacity in slots. Row b holds
`lengths[b]` committed slots at [0, lengths[b]). Slots past that are scratch: a forward writes
its new tokens' K/V there and attends to them, and `commit(n)` makes the first n of them
permanent. That one rule serves every decoding loop we have:

- AR decoding commits every token it runs;
- CDLM runs a block of masked tokens repeatedly without committing (each pass overwrites the
  same scratch slots), then commits the block once its tokens are final;
- Fast-dLLM-style decoding resets the cache and refreshes the prefix at every block start.

Physical slots and logical positions are tracked apart: `logical[b]` is the RoPE position the
next token of row b gets. They differ once a prefix is replaced by a compacted segment
(Attention Matching): t slots then stand for T > t tokens, and each compacted slot carries an
additive attention bias (beta) per KV head, kept in `biases`.

A model with sliding-window layers (Gemma 3) keeps only its global layers here; its window
layers live in `window` (`models.window_cache`), ring buffers indexed by logical position that
never grow with the sequence. Slot-wise edits (a compacted prefix, a segment of slots) apply
to the global layers alone; row-wise ones (copies, moves, resets) to both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cdlm_serve.models.window_cache import WindowCache


@dataclass(slots=True)
class KVCache:
    keys: list[Tensor]  # per layer [B, Hkv, S, D]
    values: list[Tensor]  # per layer [B, Hkv, S, D]
    lengths: list[int]  # committed physical slots per row
    logical: list[int]  # logical length per row (RoPE position of the next token)
    # Per layer [B, Hkv, S] fp32 additive key bias; None until a compacted segment exists.
    biases: list[Tensor] | None = None
    # The sliding-window layers' ring buffers (a model with such layers), else None.
    window: WindowCache | None = None

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> KVCache:
        shape = (batch, num_kv_heads, capacity, head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)],
            lengths=[0] * batch,
            logical=[0] * batch,
        )

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token's K and V take over all layers (biases, 4 bytes per KV head and
        layer, come on top once a segment is compacted)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    # ---- shape ---------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def nbytes(self, row: int | None = None) -> int:
        """Bytes the committed slots occupy (one row, or all rows)."""
        k = self.keys[0]
        per_slot = 2 * k.shape[1] * k.shape[3] * k.element_size() * self.num_layers
        if self.biases is not None:
            per_slot += self.biases[0].shape[1] * self.biases[0].element_size() * self.num_layers
        rows = self.lengths if row is None else [self.lengths[row]]
        ring = 0 if self.window is None else self.window.allocated_bytes() // self.batch
        return per_slot * sum(rows) + ring * len(rows)

    def allocated_bytes(self) -> int:
        """Bytes the buffers take, every row and every slot of capacity: what memory really
        holds (`nbytes` counts the committed slots only)."""
        buffers = [*self.keys, *self.values, *(self.biases or [])]
        ring = 0 if self.window is None else self.window.allocated_bytes()
        return sum(t.numel() * t.element_size() for t in buffers) + ring

    def trim(self) -> None:
        """Shrink every layer's buffers to the longest row's committed slots (at least one):
        gives back what forwards grew them to for scratch slots, e.g. a compaction's reference
        pass, which runs the whole context again on this cache. Views of the old buffers
        (`rows`) keep the old storage."""
        if self.window is not None:
            self.window.trim(self.logical)
        self._cut(max(1, *self.lengths))

    def shrink(self, capacity: int, live: int) -> None:
        """Cut a batch cache to `capacity` slots a row, keeping rows [0, live) (whose committed
        slots must fit) and emptying the rest (free rows, or rows already moved away). A batch
        cache grows every row for its longest one; this gives that back once the long row has
        left. The window ring (at most window + a chunk a row) stays as it is."""
        if any(n > capacity for n in self.lengths[:live]):
            raise ValueError(f"a live row holds more than {capacity} slots")
        for row in range(live, self.batch):
            self.reset(row)  # as a row that joins is: empty, its biases zero
        self._cut(capacity)

    def _cut(self, capacity: int) -> None:
        """Every layer's buffers (and biases) cut to their first `capacity` slots, copied
        so that the old storage can go; nothing where they are no longer than that."""
        if capacity >= self.capacity:
            return

        def cut(t: Tensor) -> Tensor:
            return t[:, :, :capacity].clone()

        self.keys = [cut(t) for t in self.keys]
        self.values = [cut(t) for t in self.values]
        if self.biases is not None:
            self.biases = [cut(t) for t in self.biases]

    def ensure_capacity(self, needed: int, exact: bool = False) -> None:
        """Grow every layer's buffers (doubling, or to `needed` exactly) so that `needed`
        slots fit. Doubling spares a copy per appended token; a one-off pass over scratch
        slots (a compaction's reference passes) grows exactly: doubling there twice held a
        1.5K-token session at 6,000 slots through its compaction (issue 59)."""
        if needed <= self.capacity:
            return
        new_cap = needed if exact else max(needed, 2 * self.capacity)

        def grow(t: Tensor) -> Tensor:
            # A fresh buffer, the old slots copied in and the new ones zeroed: torch.cat along
            # the slot dim was 25x slower (0.3-0.6 s of a 4K compaction's repeat pass, 60
            # buffers of [1, 3, 4K, 64] bf16 doubled).
            shape = list(t.shape)
            shape[2] = new_cap
            out = t.new_empty(shape)
            out[:, :, : t.shape[2]].copy_(t)
            out[:, :, t.shape[2] :].zero_()
            return out

        self.keys = [grow(t) for t in self.keys]
        self.values = [grow(t) for t in self.values]
        if self.biases is not None:
            self.biases = [grow(t) for t in self.biases]

    # ---- the forward pass ----------------------------------------------------------------
    def write(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Write Q new tokens' K/V (k_new, v_new [B, Hkv, Q, D]) to each row's scratch slots
        [lengths[b], lengths[b] + Q) and return the key/value views attention reads:
        [B, Hkv, max(lengths) + Q, D]."""
        q_len = k_new.shape[2]
        k_buf, v_buf = self.keys[layer], self.values[layer]
        first = self.lengths[0]
        if all(n == first for n in self.lengths):
            k_buf[:, :, first : first + q_len] = k_new
            v_buf[:, :, first : first + q_len] = v_new
            end = first + q_len
        else:
            rows, slots = self._scatter_index(q_len, k_new.device)
            # Advanced indices around a slice put the indexed dims first: [B, Q, Hkv, D].
            k_buf[rows, :, slots] = k_new.transpose(1, 2)
            v_buf[rows, :, slots] = v_new.transpose(1, 2)
            end = max(self.lengths) + q_len
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def _scatter_index(self, q_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        starts = torch.tensor(self.lengths, device=device).view(-1, 1)  # [B, 1]
        slots = starts + torch.arange(q_len, device=device).view(1, -1)  # [B, Q]
        rows = torch.arange(self.batch, device=device).view(-1, 1).expand_as(slots)
        return rows, slots

    def key_bias(self, layer: int, key_len: int) -> Tensor | None:
        """[B, Hkv, key_len] additive bias for this layer's keys, or None if no row has any."""
        if self.biases is None:
            return None
        return self.biases[layer][:, :, :key_len]

    def commit(self, counts: int | list[int]) -> None:
        """Make the first counts[b] scratch slots of each row permanent."""
        if isinstance(counts, int):
            counts = [counts] * self.batch
        for b, n in enumerate(counts):
            if n < 0:
                raise ValueError("cannot commit a negative number of slots")
            self.lengths[b] += n
            self.logical[b] += n

    def next_positions(self, q_len: int, device: torch.device) -> Tensor:
        """[B, Q] RoPE positions of Q new tokens appended to each row."""
        start = torch.tensor(self.logical, device=device).view(-1, 1)
        return start + torch.arange(q_len, device=device).view(1, -1)

    # ---- rows ------------------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> KVCache:
        """A view of rows [start, stop): same storage, its own length lists. Run a forward on
        it, then `merge_view` it back. Grow this cache's capacity first: a view that grows would
        get buffers of its own."""
        return KVCache(
            keys=[k[start:stop] for k in self.keys],
            values=[v[start:stop] for v in self.values],
            lengths=self.lengths[start:stop],
            logical=self.logical[start:stop],
            biases=None if self.biases is None else [b[start:stop] for b in self.biases],
            window=None if self.window is None else self.window.rows(start, stop),
        )

    def merge_view(self, view: KVCache, start: int = 0) -> None:
        """Take back the lengths a `rows(start, ...)` view advanced."""
        grew = view.keys[0].data_ptr() != self.keys[0][start].data_ptr()
        if self.window is not None and view.window is not None:
            grew |= view.window.keys[0].data_ptr() != self.window.keys[0][start].data_ptr()
        if grew:
            raise ValueError("the view grew its own buffers; grow the parent cache first")
        self.lengths[start : start + view.batch] = view.lengths
        self.logical[start : start + view.batch] = view.logical

    def extract_row(self, row: int) -> KVCache:
        """A new batch-1 cache holding a copy of one row's committed slots."""
        n = self.lengths[row]
        cap = max(n, 1)
        keys = [k[row : row + 1, :, :cap].clone() for k in self.keys]
        values = [v[row : row + 1, :, :cap].clone() for v in self.values]
        biases = None
        if self.biases is not None:
            biases = [b[row : row + 1, :, :cap].clone() for b in self.biases]
        window = None
        if self.window is not None:
            window = self.window.extract_row(row, self.logical[row])
        return KVCache(keys, values, [n], [self.logical[row]], biases, window)

    def load_row(self, row: int, src: KVCache, src_row: int = 0) -> None:
        """Copy another cache's row (committed slots, lengths, biases) into `row`."""
        n = src.lengths[src_row]
        self.ensure_capacity(n + 1)
        if src.biases is not None and self.biases is None:
            b, h, s, _ = self.keys[0].shape
            self.biases = [
                torch.zeros(b, h, s, device=self.keys[0].device) for _ in range(self.num_layers)
            ]
        for layer in range(self.num_layers):
            self.keys[layer][row, :, :n] = src.keys[layer][src_row, :, :n]
            self.values[layer][row, :, :n] = src.values[layer][src_row, :, :n]
            if self.biases is not None:
                self.biases[layer][row] = 0
                if src.biases is not None:
                    self.biases[layer][row, :, :n] = src.biases[layer][src_row, :, :n]
        if self.window is not None and src.window is not None:
            self.window.load_row(row, src.window, src_row, src.logical[src_row])
        elif (self.window is None) != (src.window is None):
            raise ValueError("copying a row between caches with and without window layers")
        self.lengths[row] = n
        self.logical[row] = src.logical[src_row]

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src's committed slots (and lengths) into row dst: compacts the active rows
        of a batch when a sequence leaves."""
        n = self.lengths[src]
        for buffers in (self.keys, self.values, self.biases or []):
            for buf in buffers:
                buf[dst, :, :n] = buf[src, :, :n]
        if self.window is not None:
            self.window.move_row(src, dst)
        self.lengths[dst] = n
        self.logical[dst] = self.logical[src]

    # ---- whole-sequence edits ------------------------------------------------------------
    def reset(self, row: int, length: int = 0) -> None:
        """Forget committed slots of one row past `length` (its logical length follows; an
        emptied row starts again at position 0, even after a compacted segment, whose slots
        stood for more positions than they are)."""
        if length > self.lengths[row]:
            raise ValueError("reset can only shorten a row")
        dropped = self.lengths[row] - length
        ring = self.window
        if ring is not None and length > 0 and dropped > ring.ring - ring.window:
            # The window of the new end was overwritten: its positions are gone.
            raise ValueError("a sliding-window cache cannot go back past its ring")
        self.lengths[row] = length
        self.logical[row] = 0 if length == 0 else self.logical[row] - dropped
        if self.biases is not None:
            for bias in self.biases:
                bias[row, :, length:] = 0

    def read(self, row: int, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Committed K/V [Hkv, n, D] (and bias [Hkv, n] or None) of one row and layer."""
        n = self.lengths[row]
        bias = None if self.biases is None else self.biases[layer][row, :, :n]
        return self.keys[layer][row, :, :n], self.values[layer][row, :, :n], bias

    def replace_prefix(
        self,
        row: int,
        num_slots: int,
        keys: list[Tensor],
        values: list[Tensor],
        biases: list[Tensor],
    ) -> None:
        """Replace the first `num_slots` committed slots of `row` by a compacted segment.

        keys/values: per layer [Hkv, t, D]; biases: per layer [Hkv, t] (beta). The slots after
        the prefix move down to follow the segment; their K/V already carry their RoPE
        positions, and the row's logical length is unchanged, so new tokens keep counting from
        the original length.
        """
        length = self.lengths[row]
        if not 0 < num_slots <= length:
            raise ValueError(f"prefix of {num_slots} slots is not within the {length} committed")
        t = keys[0].shape[1]
        tail = length - num_slots
        if self.biases is None:
            b, h, s, _ = self.keys[0].shape
            dev = self.keys[0].device
            self.biases = [torch.zeros(b, h, s, device=dev) for _ in range(self.num_layers)]
        for layer in range(self.num_layers):
            for buf, seg in (
                (self.keys[layer], keys[layer]),
                (self.values[layer], values[layer]),
                (self.biases[layer], biases[layer]),
            ):
                # Clone the tail first: source and destination ranges may overlap.
                rest = buf[row, :, num_slots:length].clone()
                buf[row, :, :t] = seg.to(buf.dtype)
                buf[row, :, t : t + tail] = rest
            # Scratch slots must not inherit a bias from the old layout.
            self.biases[layer][row, :, t + tail :] = 0
        self.lengths[row] = t + tail
