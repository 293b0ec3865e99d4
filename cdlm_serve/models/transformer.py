"""One decoder-only transformer for every family we serve (Llama, Qwen2/3, Dream, LLaDA).

Pre-norm blocks: x + Attn(RMSNorm(x)), then h + SwiGLU(RMSNorm(h)). q/k/v and gate/up are
fused into one projection each (fewer kernel launches per decode step; the loader fuses the
checkpoint's separate matrices). What differs per family lives in `ModelConfig` and in
`models/weights.py`; what differs per call (attention pattern, positions, cache) is an argument.
This is the PyTorch model; whether an engine step runs here or through the fused C++ step
(`models/kernels/`) is the engines' runner's choice (`engine/decoding/model_runner.py`).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from cdlm_serve.models import kernels
from cdlm_serve.models.attention import (
    AttentionMask,
    AttentionPattern,
    Band,
    build_mask,
    reread_mask,
)
from cdlm_serve.models.config import ModelConfig
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.layers import Block, Embedding, Linear, Pace, RMSNorm
from cdlm_serve.models.rope import RotaryTable, inverse_frequencies
from cdlm_serve.models.window_cache import WindowCache

# (cos, sin) of the new tokens: [Q, 1, D] (one range for the whole batch) or [B, Q, 1, D].
Rope = tuple[Tensor, Tensor]

# Per-layer query lists: capture[layer] receives each forward's post-RoPE queries [B, H, Q, D].
QueryCapture = list[list[Tensor]]


def new_capture(model: Transformer) -> QueryCapture:
    return [[] for _ in model.layers]


class Transformer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            Block(cfg, device, dtype, layer) for layer in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        )
        self._inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._rotary: RotaryTable | None = None
        # Sliding-window layers rotate with their own base (Gemma 3: 10K where global is 1M).
        self._inv_freq_local = inverse_frequencies(
            cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, None
        )
        self._rotary_local: RotaryTable | None = None
        # Layer i's index among the cache's global layers (`KVCache.keys`) or, for a
        # sliding-window layer, among its window layers (`KVCache.window`).
        local, glob = cfg.local_layers, cfg.global_layers
        self.cache_index = [
            local.index(i) if cfg.is_local(i) else glob.index(i) for i in range(cfg.num_layers)
        ]

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rotary(self, capacity: int, local: bool = False) -> RotaryTable:
        table = self._rotary_local if local else self._rotary
        if table is None or table.cos.device != self.device or table.dtype != self.dtype:
            size = max(capacity, self.config.max_position_embeddings)
            inv_freq = self._inv_freq_local if local else self._inv_freq
            table = RotaryTable(inv_freq, size, self.device, self.dtype)
            if local:
                self._rotary_local = table
            else:
                self._rotary = table
        table.ensure(capacity)
        return table

    def embed(self, input_ids: Tensor) -> Tensor:
        """ids [...] -> embeddings [..., hidden] (Gemma's scaled by sqrt(hidden), rounded to
        the model's dtype first as its reference does)."""
        x = cast(Tensor, self.embed_tokens(input_ids))
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def rope_fp32(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """fp32 cos/sin [length, D] on the CPU of positions [start, start + length), whatever
        the model's dtype and device (for fits that rotate queries themselves)."""
        cpu = torch.device("cpu")
        table = RotaryTable(self._inv_freq.cpu(), start + length, cpu, torch.float32)
        return table.cos[start:], table.sin[start:]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.config
        heads = (cfg.num_kv_heads, cfg.head_dim)
        cache = KVCache.allocate(
            len(cfg.global_layers), batch, *heads, capacity, self.device, self.dtype
        )
        if cfg.local_layers:
            assert cfg.sliding_window is not None  # the config checks it
            cache.window = WindowCache.allocate(
                len(cfg.local_layers), batch, *heads, cfg.sliding_window, self.device, self.dtype
            )
        return cache

    # ---- forward ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        *,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        pattern: AttentionPattern | None = None,
        valid: Tensor | None = None,
        commit: bool | int | Sequence[int] = True,
        capture: QueryCapture | None = None,
        rows: tuple[int, int] | None = None,
    ) -> Tensor:
        """Run Q new tokens per row and return final hidden states [B, Q, hidden].

        input_ids [B, Q]. With a cache, the tokens attend to each row's committed slots plus
        themselves, their K/V land in scratch slots, and `commit` says how many of them per row
        become permanent (True: all valid ones; False/0: none). Without a cache, the Q tokens
        are the whole sequence. `positions` [B, Q] defaults to continuing each row's logical
        length (or 0.. without a cache; cumsum(valid) - 1 when padded). `pattern` defaults to
        the family's own (causal for AR models, bidirectional for DLMs). `valid` [B, Q] marks
        padding, which no other token attends to. With `capture` (`new_capture(model)`), every
        layer's post-RoPE queries are appended to its list (on the PyTorch path). With `rows`
        (start, stop), the B rows of input are cache rows [start, stop) of a larger cache.
        """
        if rows is not None and cache is not None:
            view = self._rows_view(cache, rows, input_ids.shape[1])
            out = self.forward(
                input_ids, cache=view, positions=positions, pattern=pattern, valid=valid,
                commit=commit, capture=capture,
            )  # fmt: skip
            cache.merge_view(view, rows[0])
            return out
        batch, q_len = input_ids.shape
        if cache is not None:
            self._ensure(cache, q_len)
        explicit_positions = positions
        cos, sin, positions = self._rope_for(batch, q_len, positions, cache, valid)
        mask = self._mask(pattern, positions, cache, valid, explicit_positions is None)
        local = self._local_parts(positions, mask, cache, explicit_positions is not None)
        x = self.embed(input_ids)  # [B, Q, hidden]
        residual = None
        for i, block in enumerate(cast(Iterable[Block], self.layers)):
            parts = local if block.attn.local else ((cos, sin), mask)
            assert parts is not None  # a window layer: the model has window parts
            (c, s), m = parts
            x, residual = block(
                x, residual, c, s, m, cache, self.cache_index[i],
                None if capture is None else capture[i],
            )  # fmt: skip
        return self._finish(x, residual, cache, commit, q_len, batch, valid)

    @staticmethod
    def _ensure(cache: KVCache, q_len: int) -> None:
        """Room for q_len more tokens on every row (the global slots and the window ring)."""
        cache.ensure_capacity(max(cache.lengths) + q_len)
        if cache.window is not None:
            cache.window.ensure(q_len, cache.logical)

    def _local_parts(
        self, positions: Tensor, mask: AttentionMask, cache: KVCache | None, explicit: bool
    ) -> tuple[Rope, AttentionMask] | None:
        """The sliding-window layers' RoPE (their own base) and mask: the new tokens see the
        positions within the window up to their own, in the ring (`models.window_cache`) or,
        without a cache, among themselves under the pattern's mask. None for a model without
        such layers."""
        window = self.config.sliding_window
        if not self.config.local_layers or window is None:
            return None
        q_len = positions.shape[1]
        # The table's bound from the host where it is known (no device read on a GPU).
        bound = int(positions.max()) + 1 if explicit else max(cache.logical if cache else [0])
        rope = self.rotary(bound + (0 if explicit else q_len), local=True).lookup(positions)
        if cache is None:
            base = mask.rows(0, q_len, q_len, positions.device).visible
            near = positions[:, None, :] > positions[:, :, None] - window  # [B, Q, K=Q]
            visible = near[:, None] if base is None else base & near[:, None]
            return rope, AttentionMask(visible, False, q_len)
        if explicit or mask.reread is not None:
            # The ring holds each row's positions from its logical length on: tokens at other
            # positions (a diffusion block, a re-read) would need keys it no longer has.
            raise NotImplementedError("sliding-window layers run new tokens at their positions")
        assert cache.window is not None
        visible = cache.window.mask(positions, cache.logical, q_len)  # [B, 1, Q, R]
        return rope, AttentionMask(visible, False, cache.window.ring)

    @staticmethod
    def _rows_view(cache: KVCache, rows: tuple[int, int], q_len: int) -> KVCache:
        """Rows [start, stop) of a cache as a cache of their own (same storage), grown first
        so that q_len more tokens fit (a view that grew would get buffers of its own)."""
        cache.ensure_capacity(max(cache.lengths[rows[0] : rows[1]]) + q_len)
        if cache.window is not None:
            cache.window.ensure(q_len, cache.logical)
        return cache.rows(*rows)

    def forward_stages(
        self,
        input_ids: Tensor,
        *,
        cache: KVCache | None = None,
        commit: bool | int | Sequence[int] = True,
        rows: tuple[int, int] | None = None,
        pace: Pace | None = None,
        band: Band | None = None,
        reread: Tensor | None = None,
    ) -> Generator[Tensor | None, None, Tensor]:
        """forward() in bounded pieces, always on the PyTorch path: yields each layer's
        post-RoPE queries [B, H, Q, D] before that layer attends, None between the query
        chunks of its attention and the token chunks of its MLP (sized by `pace`, by default
        always small: `models.layers.Pace`), and returns the final hidden states. Each
        resumption runs one such chunk (the last one of a layer also the next layer's
        projections), so the caller can spread a long forward over short pieces of work, and
        may change a layer's cache slots between its queries and its attention (on-policy
        compaction). `rows` as in forward(); `band` narrows the attention of a continuation
        (`models.attention.Band`: a compaction's banded repeat pass). `reread` [Q] int64: the
        new tokens of a one-row cache are its cached tokens at these slots, read again, at
        their own positions (`models.attention.reread_mask`; commit nothing; slot s is at
        position s + logical - physical length, so on a compacted row only its slots after the
        segment are tokens to re-read)."""
        pace = pace or Pace()
        if rows is not None and cache is not None:
            view = self._rows_view(cache, rows, input_ids.shape[1])
            out = yield from self.forward_stages(
                input_ids, cache=view, commit=commit, pace=pace, band=band, reread=reread
            )
            cache.merge_view(view, rows[0])
            return out
        batch, q_len = input_ids.shape
        if cache is not None:
            self._ensure(cache, q_len)
        local = None
        if reread is not None:
            if cache is None or batch != 1 or band is not None:
                raise ValueError("reread needs a one-row cache and no band")
            if self.config.local_layers:
                # The ring holds the last positions only: earlier tokens' windows are gone.
                raise NotImplementedError("re-reading cached tokens of sliding-window models")
            slots = reread.to(self.device)  # [Q]
            # Slot s holds the token at position s + logical - physical: on a row compacted
            # before, its tokens after the segment (which stands for more tokens than slots).
            shift = cache.logical[0] - cache.lengths[0]
            cos, sin, _ = self._rope_for(batch, q_len, (slots + shift)[None], cache, None)
            mask = reread_mask(slots, cache.lengths[0])
        else:
            cos, sin, positions = self._rope_for(batch, q_len, None, cache, None)
            mask = self._mask(None, positions, cache, None, True)
            # The band narrows the global layers' attention; window layers keep their window.
            local = self._local_parts(positions, mask, cache, False)
            mask.band = band
        x = self.embed(input_ids)  # [B, Q, hidden]
        residual = None
        for i, block in enumerate(cast(Iterable[Block], self.layers)):
            parts = local if block.attn.local else ((cos, sin), mask)
            assert parts is not None  # a window layer: the model has window parts
            (c, s), m = parts
            index = self.cache_index[i]
            x, residual = yield from block.stages(x, residual, c, s, m, cache, index, pace)
        return self._finish(x, residual, cache, commit, q_len, batch, None)

    def _mask(
        self,
        pattern: AttentionPattern | None,
        positions: Tensor,
        cache: KVCache | None,
        valid: Tensor | None,
        default_positions: bool,
    ) -> AttentionMask:
        pattern = pattern or AttentionPattern(self.config.default_attention)
        # Where every row's new tokens start, when that is one host-known position.
        starts = cache.logical if cache is not None else [0]
        shared = default_positions and valid is None
        q_start = starts[0] if shared and all(n == starts[0] for n in starts) else None
        cached_lens = cache.lengths if cache is not None else None
        return build_mask(pattern, positions, cached_lens, valid, q_start)

    def _finish(
        self,
        x: Tensor,
        residual: Tensor | None,
        cache: KVCache | None,
        commit: bool | int | Sequence[int],
        q_len: int,
        batch: int,
        valid: Tensor | None,
    ) -> Tensor:
        assert residual is not None  # the last block's (every model has blocks)
        x, _ = self.norm.add_forward(x, residual)
        if cache is not None and commit is not False:
            cache.commit(self._commit_counts(commit, q_len, batch, valid))
        return x

    def _rope_for(
        self,
        batch: int,
        q_len: int,
        positions: Tensor | None,
        cache: KVCache | None,
        valid: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """cos/sin for the new tokens and their positions [B, Q]."""
        device = self.device
        starts = cache.logical if cache is not None else [0] * batch
        shared_range = positions is None and valid is None and all(s == starts[0] for s in starts)
        if shared_range:
            table = self.rotary(starts[0] + q_len)
            cos, sin = table.lookup_range(starts[0], q_len)  # [Q, 1, D]
            pos = torch.arange(starts[0], starts[0] + q_len, device=device).expand(batch, q_len)
            return cos, sin, pos
        if positions is not None:
            bound = int(positions.max()) + 1  # explicit positions: one host read for the bound
        else:
            bound = max(starts) + q_len
            if cache is not None:
                positions = cache.next_positions(q_len, device)
            elif valid is not None:
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            else:
                positions = torch.arange(q_len, device=device).expand(batch, q_len)
        cos, sin = self.rotary(bound).lookup(positions)  # [B, Q, 1, D]
        return cos, sin, positions

    @staticmethod
    def _commit_counts(
        commit: bool | int | Sequence[int], q_len: int, batch: int, valid: Tensor | None
    ) -> list[int]:
        if commit is True:
            if valid is None:
                return [q_len] * batch
            return [int(n) for n in valid.sum(-1).tolist()]
        if isinstance(commit, int):
            return [commit] * batch
        return list(commit)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> logits [..., vocab] in the model dtype."""
        fused = kernels.head_logits(self, hidden)
        if fused is not None:
            return fused
        if self.lm_head is not None:
            return cast(Tensor, self.lm_head(hidden))
        return kernels.linear(hidden, self.embed_tokens.weight)

    def token_logits(self, hidden: Tensor) -> Tensor:
        """Logits aligned with token positions: row i predicts token i.

        AR and LLaDA heads already are. Dream's head is shifted (hidden state i-1 predicts token
        i), so its rows move one place right; the first row has no predecessor in this window and
        keeps its own logits, as Dream's reference decoder does. Decoders that run a window of a
        longer sequence must supply the predecessor row themselves.
        """
        logits = self.logits(hidden)
        if not self.config.logits_shift:
            return logits
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
