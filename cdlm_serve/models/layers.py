"""The blocks the transformer is built of: projections, norms, attention, MLP, a pre-norm
block. Attention works on explicit masks and per-key biases (`models.attention`) and writes its
new keys and values into the model's KV cache (`models.kv_cache`); it can run in query chunks,
pausing between them (`Attention.attend(pace=...)`), for forwards spread over pieces of work.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cdlm_serve.models import flash_continuation, kernels
from cdlm_serve.models.attention import AttentionMask, with_key_bias
from cdlm_serve.models.config import ModelConfig
from cdlm_serve.models.kv_cache import KVCache

# Attention with an explicit mask runs in query chunks whose [B, H, chunk, K] mask and scores
# stay under this many elements (64 MB in fp32), however long the sequence and the cache.
ATTENTION_CHUNK_ELEMENTS = 1 << 24
# A staged forward (`Transformer.forward_stages`) is cut into pieces, each sized as it starts
# (`Pace`): while decode steps of the model's requests wait for them, about one decode step
# (attention over at most this many query-key pairs x heads, MLPs over this many tokens)...
STAGE_ATTENTION_ELEMENTS = 1 << 23
STAGE_MLP_TOKENS = 256
# ...and while nothing waits, larger: small pieces cost the kernels efficiency. Measured (SmolLM2
# bf16, 2 cores, a 4K-token compaction's repeat pass over 8K keys): 661 pieces of 1 << 24 pairs
# and 1,024 tokens, 25 ms at the median, took 17.1 s; 1,291 pieces of 1 << 23 and 512, 21.7 s.
STAGE_IDLE_ATTENTION_ELEMENTS = 1 << 25
STAGE_IDLE_MLP_TOKENS = 2048
# Cached tokens read again attend in chunks of at most this many (`flash_continuation.
# reread_rows`): a chunk's rows read all the slots up to its first one's unmasked, and the
# span to its last one's under a mask, so small chunks read little more than their prefixes.
REREAD_ROWS = 64


@dataclass(frozen=True, slots=True)
class Pace:
    """How large the next piece of a staged forward is, asked before each piece: small while
    `urgent()` says that decode steps wait for the pieces, large while nothing does."""

    urgent: Callable[[], bool] = lambda: True

    def attention_elements(self) -> int:
        return STAGE_ATTENTION_ELEMENTS if self.urgent() else STAGE_IDLE_ATTENTION_ELEMENTS

    def mlp_tokens(self) -> int:
        return STAGE_MLP_TOKENS if self.urgent() else STAGE_IDLE_MLP_TOKENS


def run_through(work: Generator[None, None, Tensor]) -> Tensor:
    """The result of a generator that does not pause."""
    try:
        next(work)
    except StopIteration as done:
        return cast(Tensor, done.value)
    raise RuntimeError("unexpected pause")


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `models.kernels.linear` (decode-friendly paths)."""

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding that draws no random values on the meta device (a model built to be
    loaded, `models.loading.build_model`): there are none to draw, and its normal fill on meta
    runs through torch._refs, which imports torch's compiler (~2 s of every server start)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        local: bool = False,
    ):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.scale
        # A sliding-window layer: its keys live in the cache's ring (`KVCache.window`) and its
        # mask is the window's (`Transformer` passes it).
        self.local = local
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        kw = {"device": device, "dtype": dtype}
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, **kw)
        self.q_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype) if cfg.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype) if cfg.qk_norm else None
        )

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask,
        cache: KVCache | None,
        layer: int,
        capture: list[Tensor] | None = None,
    ) -> Tensor:
        """x [B, Q, hidden] -> [B, Q, hidden]. With `capture`, the post-RoPE queries
        [B, H, Q, D] (fp32) are appended to it (Attention Matching's reference queries)."""
        q, k, v = self.project(x, cos, sin)
        if capture is not None:
            capture.append(q.detach().float().clone())
        return run_through(self.attend(q, k, v, mask, cache, layer))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, Q, hidden] -> post-RoPE q [B, H, Q, D], k and v [B, Hkv, Q, D]."""
        batch, q_len, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [B, Q, (H + 2Hkv) * D]
        if self.q_norm is not None and self.k_norm is not None:
            qk = qkv[..., : (h + hkv) * d].view(batch, q_len, h + hkv, d)
            normed = torch.cat([self.q_norm(qk[:, :, :h]), self.k_norm(qk[:, :, h:])], dim=2)
            qkv = torch.cat([normed.flatten(2), qkv[..., (h + hkv) * d :]], dim=-1)
        # q and k rotate together: one pass instead of two.
        qkv = kernels.rotate_qk(qkv, cos, sin, h + hkv, d)
        q = qkv[..., : h * d].view(batch, q_len, h, d).transpose(1, 2)  # [B, H, Q, D]
        k = qkv[..., h * d : (h + hkv) * d].view(batch, q_len, hkv, d).transpose(1, 2)
        v = qkv[..., (h + hkv) * d :].view(batch, q_len, hkv, d).transpose(1, 2)  # [B,Hkv,Q,D]
        return q, k, v

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttentionMask,
        cache: KVCache | None,
        layer: int,
        pace: Pace | None = None,
    ) -> Generator[None, None, Tensor]:
        """The new tokens' q [B, H, Q, D] and k, v [B, Hkv, Q, D] (written to the cache first,
        when there is one) -> attention output through o_proj, [B, Q, hidden]. A generator:
        with a `pace`, it runs in query chunks of the pace's size and yields None between them
        (a long forward's attention as pieces of bounded work); without, it never yields
        (`run_through`)."""
        k, v, bias = self._keys(k, v, mask, cache, layer)
        if pace is None:
            fused = _fused_decode(q, k, v, mask, bias, self.scale)
            if fused is not None:
                return cast(Tensor, self.o_proj(fused))
        aligned = not mask.is_causal or q.shape[2] == k.shape[2]  # SDPA's causal: K == Q only
        plain = bias is None and mask.visible is None and mask.band is None
        if pace is None and plain and aligned:
            out = F.scaled_dot_product_attention(  # SDPA's own kernels, no mask
                q, k, v, is_causal=mask.is_causal, scale=self.scale, enable_gqa=self._gqa
            )
            return self._output(out)
        # The CPU flash parts or the fused kernel (no [Q, K] mask): a causal continuation of a
        # cache, or cached tokens read again; each computes query rows [start, stop).
        rule = _flash_rule(q, mask)
        outs: list[Tensor] = []
        if rule is not None:
            flash_rows, fused_rows, max_rows = rule
            if kernels.packs_attention(q, k):  # the fused kernel: one call per chunk
                packed = kernels.pack_attention(k, v, bias)
                flash_rows = partial(fused_rows, q, packed, self.scale)
            else:
                kh, vh, bh = flash_continuation.per_head(k, v, bias, self.num_heads, q.dtype)
                flash_rows = partial(flash_rows, q, kh, vh, bh, self.scale)
            for start, stop in self._query_chunks(q, k, pace, None, max_rows):
                if outs:
                    yield None
                outs.append(flash_rows(start, stop))
            return self._output(torch.cat(outs, dim=2))
        for chunk in self._query_chunks(q, k, pace, ATTENTION_CHUNK_ELEMENTS):
            if outs and pace is not None:
                yield None
            outs.append(self._sdpa_rows(q, k, v, mask, bias, *chunk))
        return self._output(torch.cat(outs, dim=2))

    @property
    def _gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads

    def _keys(
        self, k: Tensor, v: Tensor, mask: AttentionMask, cache: KVCache | None, layer: int
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys and values to attend to, [B, Hkv, K, D], and their bias [B, Hkv, K] or None."""
        if cache is None:
            return k, v, None
        if self.local:
            assert cache.window is not None  # a model with window layers allocates one
            return (*cache.window.write(layer, k, v, cache.logical), None)  # the whole ring
        k, v = cache.write(layer, k, v)  # committed slots + these tokens
        return k, v, cache.key_bias(layer, mask.key_len)

    def _output(self, out: Tensor) -> Tensor:
        batch, h, q_len, d = out.shape  # [B, H, Q, D]
        return cast(Tensor, self.o_proj(out.transpose(1, 2).reshape(batch, q_len, h * d)))

    @staticmethod
    def _query_chunks(
        q: Tensor, k: Tensor, pace: Pace | None, limit: int | None, max_rows: int | None = None
    ) -> Iterator[tuple[int, int]]:
        """Query rows [start, stop) whose [B, H, rows, K] query-key pairs stay under `limit`
        (ATTENTION_CHUNK_ELEMENTS: an explicit mask, a per-key bias on compacted slots or a
        visibility mask, would otherwise make SDPA build a float mask and a score matrix over
        all of [B, H, Q, K], gigabytes for a long sequence over a long cache) and the pace's
        piece size, asked anew before each chunk (the caller yields between them), and at most
        `max_rows` rows."""
        batch, h, q_len, _ = q.shape
        pairs = max(1, batch * h * k.shape[2])
        start = 0
        while start < q_len:
            elements = min(limit or 1 << 62, pace.attention_elements() if pace else 1 << 62)
            rows = min(max(1, elements // pairs), max_rows or q_len)
            stop = min(q_len, start + rows)
            yield start, stop
            start = stop

    def _sdpa_rows(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttentionMask,
        bias: Tensor | None,
        start: int,
        stop: int,
    ) -> Tensor:
        """SDPA of query rows [start, stop) -> [B, H, stop - start, D]."""
        h, q_len = q.shape[1], q.shape[2]
        part = mask.rows(start, stop, q_len, q.device)
        attn_mask = part.visible
        if bias is not None:
            attn_mask = with_key_bias(part, bias, stop - start, h, q.dtype)
        return F.scaled_dot_product_attention(
            q[:, :, start:stop], k, v, attn_mask=attn_mask, scale=self.scale, enable_gqa=self._gqa
        )


def _tokens(table: Tensor, rows: slice) -> Tensor:
    """cos/sin [Q, 1, D] or [B, Q, 1, D] -> the rows' [.., q, 1, D]."""
    return table[..., rows, :, :]


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias, **kw)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias, **kw)
        self.act = cfg.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2I]
        if self.act == "silu":
            return cast(Tensor, self.down_proj(kernels.silu_mul(gate_up)))
        return cast(Tensor, self.down_proj(kernels.gelu_mul(gate_up)))


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        layer: int = 0,
    ):
        super().__init__()
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.attn_norm = norm()
        self.attn = Attention(cfg, device, dtype, local=cfg.is_local(layer))
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, device, dtype)
        # Gemma's sandwich: the attention's and the MLP's outputs normed before their adds.
        self.attn_post_norm = norm() if cfg.sandwich_norms else None
        self.mlp_post_norm = norm() if cfg.sandwich_norms else None

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask,
        cache: KVCache | None,
        layer: int,
        capture: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Pre-norm block on the residual stream. Returns (this block's MLP output, the
        residual stream before it): the add happens inside the next norm, fused."""
        h, residual = self._attention_input(x, residual)
        h = self.attn(h, cos, sin, mask, cache, layer, capture)
        return self._after_attention(h, residual)

    def stages(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask,
        cache: KVCache | None,
        layer: int,
        pace: Pace,
    ) -> Generator[Tensor | None, None, tuple[Tensor, Tensor]]:
        """forward() in pieces: yields the post-RoPE queries [B, H, Q, D] before attending
        (the caller may change this layer's cache slots meanwhile), then None between the
        query chunks of its attention and the token chunks of its MLP (`pace`'s sizes), then
        finishes."""
        h, residual = self._attention_input(x, residual)
        parts: list[tuple[Tensor, Tensor, Tensor]] = []
        start = 0
        while start < h.shape[1]:  # the projections too, per token chunk: exact
            if parts:
                yield None
            stop = start + pace.mlp_tokens()
            rows = slice(start, min(stop, h.shape[1]))
            parts.append(self.attn.project(h[:, rows], _tokens(cos, rows), _tokens(sin, rows)))
            start = stop
        q, k, v = (torch.cat(t, dim=2) for t in zip(*parts, strict=True))
        yield q
        h = yield from self.attn.attend(q, k, v, mask, cache, layer, pace)
        h, residual = self.mlp_norm.add_forward(self._post(self.attn_post_norm, h), residual)
        outs = []
        start = 0
        while start < h.shape[1]:  # per token: any split is exact
            yield None
            stop = start + pace.mlp_tokens()
            outs.append(self.mlp(h[:, start:stop]))
            start = stop
        return self._post(self.mlp_post_norm, torch.cat(outs, dim=1)), residual

    def _attention_input(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            return self.attn_norm(x), x
        return self.attn_norm.add_forward(x, residual)

    def _after_attention(self, h: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        h, residual = self.mlp_norm.add_forward(self._post(self.attn_post_norm, h), residual)
        return self._post(self.mlp_post_norm, self.mlp(h)), residual

    @staticmethod
    def _post(norm: RMSNorm | None, h: Tensor) -> Tensor:
        return h if norm is None else norm(h)


def _whole_buffer(t: Tensor) -> Tensor | None:
    """The [B, Hkv, S, D] buffer a view of its first K slots (t [B, Hkv, K, D], what a cache's
    `write` returns) was cut from, or None if t is not such a view."""
    b, hkv, _, d = t.shape
    if t.stride(3) != 1 or t.stride(2) != d or t.stride(1) % d:
        return None
    slots = t.stride(1) // d
    if t.stride(0) != hkv * t.stride(1) and b > 1:
        return None
    # The slots past K must lie in t's own storage (never read past it, whatever t is).
    last = t.storage_offset() + (b - 1) * t.stride(0) + hkv * t.stride(1)
    if last * t.element_size() > t.untyped_storage().nbytes():
        return None
    return t.as_strided((b, hkv, slots, d), t.stride(), t.storage_offset())


def _fused_decode(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, bias: Tensor | None, scale: float
) -> Tensor | None:
    """One new token per row (a decode step on the PyTorch path: a model the fused step does
    not take, such as Gemma 3) through the fused CPU attention kernel: q [B, H, 1, D] over the
    cache's keys k, v [B, Hkv, K, D] (views of its buffers), the mask's invisible keys (a
    padded row's, a sliding window's ring slots out of the window) as -inf bias beside the
    cache's own. Returns [B, 1, H * D], or None where it does not apply. SDPA took ~0.5 ms a
    layer for this on Gemma 3 270M's 256-wide heads, the kernel tens of us."""
    if q.shape[2] != 1 or mask.band is not None or mask.reread is not None:
        return None
    if mask.visible is not None and mask.visible.shape[-1] != k.shape[2]:
        return None
    if not kernels.fuses_decode_attention(q[:, :, 0], k):
        return None
    keys, values = _whole_buffer(k), _whole_buffer(v)
    if keys is None or values is None:
        return None
    batch, hkv, key_len = k.shape[0], k.shape[1], k.shape[2]
    full_bias = None
    if bias is not None or mask.visible is not None:
        full_bias = torch.zeros(batch, hkv, keys.shape[2], dtype=torch.float32)
        if bias is not None:
            full_bias[:, :, :key_len] = bias
        if mask.visible is not None:  # [B or 1, 1, 1, K] -> [B or 1, 1, K]
            hidden = ~mask.visible[:, :, 0, :key_len]
            full_bias[:, :, :key_len].masked_fill_(hidden, float("-inf"))
    out = kernels.decode_attention(
        q[:, :, 0], keys, values, [key_len] * batch, scale, full_bias
    )  # [B, H * D]
    return out.view(batch, 1, -1)


def _flash_rule(
    q: Tensor, mask: AttentionMask
) -> tuple[Callable[..., Tensor], Callable[..., Tensor], int | None] | None:
    """How query rows of this attention are computed without a [Q, K] mask, where they can be:
    (the flash parts' function, the fused kernel's, the most rows per chunk), else None."""
    if flash_continuation.applies(q, mask):
        return (
            partial(flash_continuation.attend_rows, band=mask.band),
            partial(flash_continuation.packed_rows, band=mask.band),
            None,
        )
    if flash_continuation.rereads(q, mask):
        assert mask.reread is not None  # what rereads() checked
        return (
            partial(flash_continuation.reread_rows, slots=mask.reread),
            partial(flash_continuation.packed_reread, slots=mask.reread),
            REREAD_ROWS,
        )
    return None
