"""One decoder-only transformer for every family we serve (Llama, Qwen2/3, Dream, LLaDA).

Pre-norm blocks: x + Attn(RMSNorm(x)), then h + SwiGLU(RMSNorm(h)). q/k/v and gate/up are
fused into one projection each (fewer kernel launches per decode step; the loader fuses the
checkpoint's separate matrices). What differs per family lives in `ModelConfig` and in
`models/weights.py`; what differs per call (attention pattern, positions, cache) is an argument.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import kernels
from models.attention import AttentionMask, AttentionPattern, build_mask, with_key_bias
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.rope import RotaryTable, inverse_frequencies

# Attention with an explicit mask runs in query chunks whose [B, H, chunk, K] mask and scores
# stay under this many elements (64 MB in fp32), however long the sequence and the cache.
ATTENTION_CHUNK_ELEMENTS = 1 << 24
# A staged forward (`Transformer.forward_stages`) runs its MLPs this many tokens per piece.
STAGE_MLP_TOKENS = 1024
# Up to this many prompt tokens per step are prefilled inside the fused CPU step (`extend`);
# longer prompts take the PyTorch path. Measured on SmolLM2, one prompt, 2 cores: fused vs
# PyTorch 22 vs 91 ms at 20 tokens, 84 vs 102 at 128, 220 vs 175 at 256 (the fused attention
# is a plain per-query loop; SDPA wins on long prompts).
FUSED_PREFILL_TOKENS = 128


def _runs(chunks: Sequence[tuple[int, Sequence[int]]]) -> list[list[tuple[int, Sequence[int]]]]:
    """Chunks grouped into runs of consecutive rows that are all decode steps (one token) or
    all prompts, in order."""
    runs: list[list[tuple[int, Sequence[int]]]] = []
    for row, tokens in chunks:
        last = runs[-1][-1] if runs else None
        if last is not None and row == last[0] + 1 and (len(tokens) == 1) == (len(last[1]) == 1):
            runs[-1].append((row, tokens))
        else:
            runs.append([(row, tokens)])
    return runs


def run_through(work: Generator[None, None, Tensor]) -> Tensor:
    """The result of a generator that does not pause."""
    try:
        next(work)
    except StopIteration as done:
        return done.value
    raise RuntimeError("unexpected pause")


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `models.kernels.linear` (decode-friendly paths)."""

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        kw = {"device": device, "dtype": dtype}
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, **kw)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None

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
        pause: bool = False,
    ) -> Generator[None, None, Tensor]:
        """The new tokens' q [B, H, Q, D] and k, v [B, Hkv, Q, D] (written to the cache first,
        when there is one) -> attention output through o_proj, [B, Q, hidden]. A generator:
        with `pause`, it runs in query chunks and yields None between them (a long forward's
        attention as pieces of bounded work); without, it never yields (`run_through`)."""
        k, v, bias = self._keys(k, v, mask, cache, layer)
        aligned = not mask.is_causal or q.shape[2] == k.shape[2]  # SDPA's causal: K == Q only
        if not pause and bias is None and mask.visible is None and aligned:
            out = F.scaled_dot_product_attention(  # SDPA's own kernels, no mask
                q, k, v, is_causal=mask.is_causal, scale=self.scale, enable_gqa=self._gqa
            )
            return self._output(out)
        outs = []
        for chunk in self._query_chunks(q, k):
            if outs and pause:
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
        k, v = cache.write(layer, k, v)  # committed slots + these tokens
        return k, v, cache.key_bias(layer, mask.key_len)

    def _output(self, out: Tensor) -> Tensor:
        batch, h, q_len, d = out.shape  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, h * d))

    @staticmethod
    def _query_chunks(q: Tensor, k: Tensor) -> list[tuple[int, int]]:
        """Query rows [start, stop) whose [B, H, rows, K] mask and scores stay under
        ATTENTION_CHUNK_ELEMENTS: an explicit mask (a per-key bias on compacted slots, or a
        visibility mask) would otherwise make SDPA build a float mask and a score matrix over
        all of [B, H, Q, K], gigabytes for a long sequence over a long cache."""
        batch, h, q_len, _ = q.shape
        rows = max(1, ATTENTION_CHUNK_ELEMENTS // max(1, batch * h * k.shape[2]))
        return [(start, min(q_len, start + rows)) for start in range(0, q_len, rows)]

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


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias, **kw)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.attn = Attention(cfg, device, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos, sin, mask, cache, layer, capture=None
    ) -> tuple[Tensor, Tensor]:
        """Pre-norm block on the residual stream. Returns (this block's MLP output, the
        residual stream before it): the add happens inside the next norm, fused."""
        h, residual = self._attention_input(x, residual)
        h = self.attn(h, cos, sin, mask, cache, layer, capture)
        return self._after_attention(h, residual)

    def stages(
        self, x: Tensor, residual: Tensor | None, cos, sin, mask, cache, layer
    ) -> Generator[Tensor | None, None, tuple[Tensor, Tensor]]:
        """forward() in pieces: yields the post-RoPE queries [B, H, Q, D] before attending
        (the caller may change this layer's cache slots meanwhile), then None between the
        query chunks of its attention and the token chunks of its MLP, then finishes."""
        h, residual = self._attention_input(x, residual)
        q, k, v = self.attn.project(h, cos, sin)
        yield q
        h = yield from self.attn.attend(q, k, v, mask, cache, layer, pause=True)
        h, residual = self.mlp_norm.add_forward(h, residual)
        outs = []
        for start in range(0, h.shape[1], STAGE_MLP_TOKENS):  # per token: any split is exact
            yield None
            outs.append(self.mlp(h[:, start : start + STAGE_MLP_TOKENS]))
        return torch.cat(outs, dim=1), residual

    def _attention_input(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            return self.attn_norm(x), x
        return self.attn_norm.add_forward(x, residual)

    def _after_attention(self, h: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        h, residual = self.mlp_norm.add_forward(h, residual)
        return self.mlp(h), residual


# Per-layer query lists: capture[layer] receives each forward's post-RoPE queries [B, H, Q, D].
QueryCapture = list[list[Tensor]]


def new_capture(model: Transformer) -> QueryCapture:
    return [[] for _ in model.layers]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(Block(cfg, device, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        )
        self._inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._rotary: RotaryTable | None = None

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rotary(self, capacity: int) -> RotaryTable:
        table = self._rotary
        if table is None or table.cos.device != self.device or table.dtype != self.dtype:
            size = max(capacity, self.config.max_position_embeddings)
            table = self._rotary = RotaryTable(self._inv_freq, size, self.device, self.dtype)
        table.ensure(capacity)
        return table

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache.allocate(
            cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, self.device, self.dtype
        )

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
            kwargs = {"positions": positions, "pattern": pattern, "valid": valid}
            out = self.forward(input_ids, cache=view, commit=commit, capture=capture, **kwargs)
            cache.absorb(view, rows[0])
            return out
        batch, q_len = input_ids.shape
        if cache is not None:
            cache.ensure_capacity(max(cache.lengths) + q_len)
        explicit_positions = positions
        cos, sin, positions = self._rope_for(batch, q_len, positions, cache, valid)
        if (
            cache is not None
            and q_len == 1
            and valid is None
            and commit is not False
            and capture is None
        ):
            stack = kernels.decode_stack(self)
            if stack is not None:
                # One new token per row, committed: the fused C++ step runs every layer.
                return self._fused_decode(stack, input_ids, cos, sin, cache, commit)
        mask = self._mask(pattern, positions, cache, valid, explicit_positions is None)
        x = self.embed_tokens(input_ids)  # [B, Q, hidden]
        residual = None
        for i, block in enumerate(self.layers):
            x, residual = block(
                x, residual, cos, sin, mask, cache, i, None if capture is None else capture[i]
            )
        return self._finish(x, residual, cache, commit, q_len, batch, valid)

    @staticmethod
    def _rows_view(cache: KVCache, rows: tuple[int, int], q_len: int) -> KVCache:
        """Rows [start, stop) of a cache as a cache of their own (same storage), grown first
        so that q_len more tokens fit (a view that grew would get buffers of its own)."""
        cache.ensure_capacity(max(cache.lengths[rows[0] : rows[1]]) + q_len)
        return cache.rows(*rows)

    def extend(self, chunks: Sequence[tuple[int, Sequence[int]]], cache: KVCache) -> Tensor:
        """Append new tokens to rows of `cache` and commit them: the engines' one entry for a
        step. Returns the final hidden state of each chunk's last token [len(chunks), hidden].

        chunks: (row, token ids) pairs, rows distinct; one id is a decode step, several are a
        prompt (causal within itself, after the row's committed slots). The fused CPU step
        takes them all in one call where it applies (bf16 on a CPU with AVX512-BF16) and the
        prompts are short enough (`FUSED_PREFILL_TOKENS` together: its attention is a plain
        per-query loop, SDPA wins on long prompts); elsewhere the PyTorch path runs one
        forward per run of consecutive rows of one kind (decode steps, or padded prompts)."""
        prompts = sum(len(tokens) for _, tokens in chunks if len(tokens) > 1)
        if prompts <= FUSED_PREFILL_TOKENS:
            hidden = self.fused_step(chunks, cache)
            if hidden is not None:
                return hidden
        return torch.cat([self._extend_run(run, cache) for run in _runs(chunks)])

    def _extend_run(self, run: list[tuple[int, Sequence[int]]], cache: KVCache) -> Tensor:
        """PyTorch path of `extend` for chunks on consecutive rows: one padded forward."""
        device, width = self.device, max(len(tokens) for _, tokens in run)
        ids = torch.zeros(len(run), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(run), width, dtype=torch.bool, device=device)
        for i, (_, tokens) in enumerate(run):
            ids[i, : len(tokens)] = torch.tensor(list(tokens), device=device)
            valid[i, : len(tokens)] = True
        ragged = any(len(tokens) != width for _, tokens in run)
        first = run[0][0]
        hidden = self(
            ids, cache=cache, rows=(first, first + len(run)), valid=valid if ragged else None
        )  # [k, W, hidden]
        last = torch.tensor([len(tokens) - 1 for _, tokens in run], device=device)
        return hidden[torch.arange(len(run), device=device), last]

    def forward_stages(
        self,
        input_ids: Tensor,
        *,
        cache: KVCache | None = None,
        commit: bool | int | Sequence[int] = True,
        rows: tuple[int, int] | None = None,
    ) -> Generator[Tensor | None, None, Tensor]:
        """forward() in bounded pieces, always on the PyTorch path: yields each layer's
        post-RoPE queries [B, H, Q, D] before that layer attends, None between the query
        chunks of its attention (`ATTENTION_CHUNK_ELEMENTS`) and the token chunks of its MLP
        (`STAGE_MLP_TOKENS`), and returns the final hidden states. Each resumption runs one
        such chunk (the last one of a layer also the next layer's projections), so the caller
        can spread a long forward over short pieces of work, and may change a layer's cache
        slots between its queries and its attention (on-policy compaction). `rows` as in
        forward()."""
        if rows is not None and cache is not None:
            view = self._rows_view(cache, rows, input_ids.shape[1])
            out = yield from self.forward_stages(input_ids, cache=view, commit=commit)
            cache.absorb(view, rows[0])
            return out
        batch, q_len = input_ids.shape
        if cache is not None:
            cache.ensure_capacity(max(cache.lengths) + q_len)
        cos, sin, positions = self._rope_for(batch, q_len, None, cache, None)
        mask = self._mask(None, positions, cache, None, True)
        x = self.embed_tokens(input_ids)  # [B, Q, hidden]
        residual = None
        for i, block in enumerate(self.layers):
            x, residual = yield from block.stages(x, residual, cos, sin, mask, cache, i)
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

    def _finish(self, x, residual, cache, commit, q_len, batch, valid) -> Tensor:
        x, _ = self.norm.add_forward(x, residual)
        if cache is not None and commit is not False:
            cache.commit(self._commit_counts(commit, q_len, batch, valid))
        return x

    def _fused_decode(self, stack, input_ids, cos, sin, cache, commit) -> Tensor:
        batch, d = input_ids.shape[0], self.config.head_dim
        x = self.embed_tokens(input_ids.view(batch))  # [B, hidden]
        cos2 = cos.expand(batch, 1, 1, d).reshape(batch, d).contiguous()
        sin2 = sin.expand(batch, 1, 1, d).reshape(batch, d).contiguous()
        rows = list(range(batch))
        attend = [n + 1 for n in cache.lengths]
        hidden = stack.forward(
            x, cache.keys, cache.values, cache.biases, rows, cache.lengths, attend, cos2, sin2
        )
        cache.commit(self._commit_counts(commit, 1, batch, None))
        return hidden.view(batch, 1, -1)

    def fused_step(
        self, chunks: Sequence[tuple[int, Sequence[int]]], cache: KVCache
    ) -> Tensor | None:
        """Append new tokens to several rows of `cache` in one fused C++ call and commit them.

        chunks: (row, token ids) pairs, rows distinct; one id is a decode step, several are a
        prompt (causal within itself, after the row's committed slots), and decode rows and
        prompts share the call, so the weights stream from memory once for all of them.
        Returns the final hidden state of each chunk's last token [len(chunks), hidden], or
        None where the fused kernels do not apply (GPU, fp32, ...): use forward() then.
        """
        rows: list[int] = []
        slots: list[int] = []
        ids: list[int] = []
        last: list[int] = []  # index of each chunk's last token
        for row, tokens in chunks:
            rows += [row] * len(tokens)
            slots += range(cache.lengths[row], cache.lengths[row] + len(tokens))
            ids += tokens
            last.append(len(ids) - 1)
        hidden = self.fused_tokens(ids, rows, slots, [s + 1 for s in slots], cache)
        if hidden is None:
            return None
        counts = [0] * cache.batch
        for row, tokens in chunks:
            counts[row] = len(tokens)
        cache.commit(counts)
        return hidden[last]

    def fused_tokens(
        self,
        ids: Sequence[int],
        rows: Sequence[int],
        slots: Sequence[int],
        attend: Sequence[int],
        cache: KVCache,
    ) -> Tensor | None:
        """The fused C++ step over arbitrary new tokens, committing nothing: token t (id
        ids[t]) of cache row rows[t] writes its K/V to slot slots[t] and attends to that row's
        slots [0, attend[t]); its RoPE position is the row's logical length plus its offset
        past the committed slots. attend = slots + 1 is causal (decode, prompts); a block whose
        tokens all attend to its end is bidirectional within itself (diffusion blocks).
        Returns hidden states [T, hidden], or None where the fused kernels do not apply."""
        stack = kernels.decode_stack(self)
        if stack is None:
            return None
        positions = [
            cache.logical[r] + s - cache.lengths[r] for r, s in zip(rows, slots, strict=True)
        ]
        cache.ensure_capacity(max(max(slots) + 1, max(attend)))
        device, d = self.device, self.config.head_dim
        cos, sin = self.rotary(max(positions) + 1).lookup(torch.tensor([positions], device=device))
        x = self.embed_tokens(torch.tensor(list(ids), device=device))  # [T, hidden]
        return stack.forward(
            x,
            cache.keys,
            cache.values,
            cache.biases,
            list(rows),
            list(slots),
            list(attend),
            cos.reshape(-1, d).contiguous(),  # [T, D]
            sin.reshape(-1, d).contiguous(),
        )

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
            return self.lm_head(hidden)
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
