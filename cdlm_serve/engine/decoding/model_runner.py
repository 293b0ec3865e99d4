"""Between the engines and the model: one step's tokens on rows of a batch cache, run either
through the fused C++ step (bf16 on CPUs with AVX2 or AVX512-BF16: `models.kernels.DecodeStack`)
or the PyTorch path, padded per run of rows. The choice is made here, once per call from the model
(whether its fused stack exists: built once per model, toggled only by tests and benches) and
the call's shape (`FUSED_PREFILL_TOKENS`, `FUSED_STEP_TOKENS`); neither path is tried and
fallen back from. `Transformer` stays the model: a forward over [B, Q] tokens and its cache.

Batch-invariant mode (`batch_invariant`, `--batch-invariant`): every call the fused step can
take goes through it, whatever its shape. The fused step gives a token the same bits whatever
else the call holds: each linear sums a row's K in one fixed order for any number of rows
(`linear_packed_bf16`, `linear_q8`), and attention is one (query, head) task over the row's own
slots in fixed key blocks (`attend_rows`). So a row's answer no longer depends on its batch
neighbours, on where its prompt was cut into chunks, or on whether its prefix came from the
prefix cache or a session file (their K/V were computed by the same kernels). The PyTorch path
is not invariant: its GEMMs and SDPA pick their splits from the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.models import kernels
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.transformer import Transformer

# Up to this many prompt tokens per step are prefilled inside the fused CPU step (`extend`);
# longer prompts take the PyTorch path. Measured on SmolLM2, one prompt, 2 cores: fused vs
# PyTorch 22 vs 91 ms at 20 tokens, 84 vs 102 at 128, 220 vs 175 at 256 (the fused attention
# is a plain per-query loop; SDPA wins on long prompts).
FUSED_PREFILL_TOKENS = 128

# Diffusion passes of up to this many tokens (all rows together) run through the fused step,
# longer ones through PyTorch. Measured here (bf16, 2 cores, one row of T new bidirectional
# tokens, 0 or 64 cached): fused / PyTorch time at T = 128 / 192 / 256 was 0.71-0.75 /
# 0.90-0.95 / 1.03-1.04 on the shipped teacher (d 256, 6 layers), 0.87-0.90 / 0.97 / 0.98-1.07
# on a d 512, 8-layer LLaDA, 0.72-0.86 / 0.84-0.99 / 0.87-1.09 on SmolLM2's shapes (d 576, 30
# layers): the fused step's per-row matmuls and per-query attention lose to GEMMs past ~200
# tokens, whatever the decoding mode.
FUSED_STEP_TOKENS = 192

Chunks = Sequence[tuple[int, Sequence[int]]]  # (cache row, token ids) pairs, rows distinct


class ModelRunner:
    def __init__(self, model: Transformer, batch_invariant: bool = False):
        self.model = model
        self.batch_invariant = batch_invariant  # asked for; `invariance` says if it holds

    def stack(self) -> Any | None:
        """The model's fused step, or None where it does not apply (GPU, fp32, kernels off)."""
        return kernels.decode_stack(self.model)

    def invariant_stack(self) -> Any | None:
        """The fused step when batch-invariant mode is asked for and holds: every call goes
        through it then. None when not asked, or where it cannot hold (`invariance`)."""
        if not self.batch_invariant or self.model.config.local_layers:
            return None
        return self.stack()

    def invariance(self) -> str:
        """Whether batch-invariant mode is on, and if not why, for the start-up log."""
        if not self.batch_invariant:
            return "off (--batch-invariant 0)"
        if self.model.config.local_layers:
            # The window step takes one token a row: prompts take the PyTorch path.
            return "off (sliding-window layers: their prompts take the PyTorch path)"
        if self.invariant_stack() is None:
            return "off (no fused CPU step here: a GPU, float32, or kernels off)"
        return f"on (every step through the fused {kernels.active_isa()} step)"

    # ---- autoregressive steps ------------------------------------------------------------
    def extend(self, chunks: Chunks, cache: KVCache) -> Tensor:
        """Append new tokens to rows of `cache` and commit them. Returns the final hidden
        state of each chunk's last token [len(chunks), hidden] (see `extend_tokens`)."""
        return self.extend_tokens(chunks, cache)[last_tokens(chunks)]

    def extend_tokens(self, chunks: Chunks, cache: KVCache) -> Tensor:
        """Append new tokens to rows of `cache` and commit them: the AR engine's one call a
        step. Returns every new token's final hidden state, chunk after chunk [T, hidden]
        (a prompt's, for its tokens' logprobs).

        One id is a decode step, several are a prompt (causal within itself, after the row's
        committed slots). The fused step takes them all in one call where it applies and the
        prompts are short enough (`FUSED_PREFILL_TOKENS` together); elsewhere the PyTorch path
        runs one forward per run of consecutive rows of one kind (decode steps, or prompts).
        In batch-invariant mode the fused step takes every call."""
        invariant = self.invariant_stack()
        if invariant is not None:
            return self.fused_step_tokens(invariant, chunks, cache)
        prompts = sum(len(tokens) for _, tokens in chunks if len(tokens) > 1)
        stack = self.stack()
        # A sliding-window model's fused step takes decode steps only: its window bias is a
        # row's (one token a row), and prompts need the ring grown past the window.
        windowed = bool(self.model.config.local_layers)
        if stack is not None and prompts <= (0 if windowed else FUSED_PREFILL_TOKENS):
            return self.fused_step_tokens(stack, chunks, cache)
        return torch.cat([self._extend_run(run, cache) for run in _runs(chunks)])

    def _extend_run(self, run: list[tuple[int, Sequence[int]]], cache: KVCache) -> Tensor:
        """PyTorch path of `extend_tokens` for chunks on consecutive rows: one padded forward;
        every new token's hidden state [sum of lengths, hidden]."""
        device, width = self.model.device, max(len(tokens) for _, tokens in run)
        ids = torch.zeros(len(run), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(run), width, dtype=torch.bool, device=device)
        for i, (_, tokens) in enumerate(run):
            ids[i, : len(tokens)] = torch.tensor(list(tokens), device=device)
            valid[i, : len(tokens)] = True
        ragged = any(len(tokens) != width for _, tokens in run)
        first = run[0][0]
        hidden: Tensor = self.model(
            ids, cache=cache, rows=(first, first + len(run)), valid=valid if ragged else None
        )  # [k, W, hidden]
        return hidden[valid] if ragged else hidden.flatten(0, 1)  # row-major: chunk by chunk

    def fused_step(self, stack: Any, chunks: Chunks, cache: KVCache) -> Tensor:
        """`extend` through the fused step: each chunk's last token [len(chunks), hidden]."""
        return self.fused_step_tokens(stack, chunks, cache)[last_tokens(chunks)]

    def fused_step_tokens(self, stack: Any, chunks: Chunks, cache: KVCache) -> Tensor:
        """`extend_tokens` through the fused step: decode rows and prompts share one call, so
        the weights stream from memory once for all of them [T, hidden]."""
        rows: list[int] = []
        slots: list[int] = []
        ids: list[int] = []
        for row, tokens in chunks:
            rows += [row] * len(tokens)
            slots += range(cache.lengths[row], cache.lengths[row] + len(tokens))
            ids += tokens
        hidden = self.fused_tokens(stack, ids, rows, slots, [s + 1 for s in slots], cache)
        counts = [0] * cache.batch
        for row, tokens in chunks:
            counts[row] = len(tokens)
        cache.commit(counts)
        return hidden

    # ---- any new tokens ------------------------------------------------------------------
    def fits_fused_pass(self, tokens: int) -> Any | None:
        """The fused step for a diffusion pass of `tokens` new tokens (all rows), or None if
        the PyTorch path is the one for it (`FUSED_STEP_TOKENS`; in batch-invariant mode any
        pass is fused: a block is never split across calls, it is bidirectional)."""
        invariant = self.invariant_stack()
        if invariant is not None:
            return invariant
        if tokens > FUSED_STEP_TOKENS or self.model.config.local_layers:
            return None
        return self.stack()

    def fused_tokens(
        self,
        stack: Any,
        ids: Sequence[int],
        rows: Sequence[int],
        slots: Sequence[int],
        attend: Sequence[int],
        cache: KVCache,
    ) -> Tensor:
        """The fused step over arbitrary new tokens, committing nothing: token t (id ids[t])
        of cache row rows[t] writes its K/V to slot slots[t] and attends to that row's slots
        [0, attend[t]); its RoPE position is the row's logical length plus its offset past the
        committed slots. attend = slots + 1 is causal (decode, prompts); a block whose tokens
        all attend to its end is bidirectional within itself (diffusion blocks).
        Returns hidden states [T, hidden]."""
        model = self.model
        positions = [
            cache.logical[r] + s - cache.lengths[r] for r, s in zip(rows, slots, strict=True)
        ]
        cache.ensure_capacity(max(max(slots) + 1, max(attend)))
        device, d = model.device, model.config.head_dim
        cos, sin = model.rotary(max(positions) + 1).lookup(torch.tensor([positions], device=device))
        x = model.embed(torch.tensor(list(ids), device=device))  # [T, hidden]
        args = [
            x,
            cache.keys,
            cache.values,
            cache.biases,
            list(rows),
            list(slots),
            list(attend),
            cos.reshape(-1, d).contiguous(),  # [T, D]
            sin.reshape(-1, d).contiguous(),
        ]
        if cache.window is None:
            hidden: Tensor = stack.forward(*args)  # the fused kernels' extension: untyped
            return hidden
        hidden = stack.forward_windowed(*args, *self._window_args(rows, positions, cache))
        return hidden

    def _window_args(self, rows: Sequence[int], positions: list[int], cache: KVCache) -> list[Any]:
        """The sliding-window layers' side of a fused step of one token a row (rows[t] at
        position positions[t]): the rings, each token's ring slot, the bias [B, Hkv, R] that
        hides each row's slots outside its token's window (as `WindowCache.mask` sees them),
        and the window layers' RoPE [T, D]."""
        window = cache.window
        assert window is not None
        window.ensure(1, cache.logical)
        model, device = self.model, self.model.device
        pos = torch.tensor(positions, device=device)  # [T]
        held = window.positions(pos)  # [T, R]: what each slot holds once the token is written
        visible = (held >= 0) & (held > pos[:, None] - window.window)  # [T, R]
        bias = torch.zeros(cache.batch, model.config.num_kv_heads, window.ring, device=device)
        hidden = torch.full_like(visible, float("-inf"), dtype=bias.dtype)
        bias[torch.tensor(list(rows), device=device)] = torch.where(visible, 0.0, hidden)[:, None]
        cos, sin = model.rotary(max(positions) + 1, local=True).lookup(pos[None])
        d = model.config.head_dim
        return [
            window.keys,
            window.values,
            [p % window.ring for p in positions],
            bias,
            cos.reshape(-1, d).contiguous(),
            sin.reshape(-1, d).contiguous(),
        ]

    # ---- the model's own calls -----------------------------------------------------------
    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """`Transformer.forward` (padded rows, a row range of a cache, a pattern)."""
        hidden: Tensor = self.model(input_ids, **kwargs)  # nn.Module.__call__ returns Any
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.logits(hidden)

    @property
    def device(self) -> torch.device:
        return self.model.device


def last_tokens(chunks: Chunks) -> list[int]:
    """Where each chunk's last token is among all the chunks' tokens, in order."""
    ends, total = [], 0
    for _, tokens in chunks:
        total += len(tokens)
        ends.append(total - 1)
    return ends


def _runs(chunks: Chunks) -> list[list[tuple[int, Sequence[int]]]]:
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
