"""Diffusion-LM decoding: CDLM and the two baselines it is measured against, batched.

All three produce the answer block by block (blocks of B tokens, left to right). Inside the
current block, masked positions are filled over several steps; each step is one forward pass.
They differ in what that pass runs over:

- cdlm (a block-causal student): the prompt is prefilled once into a KV cache; a step runs only
  the current block against the cache (bidirectional inside the block, causal to the past);
  every masked token whose confidence reaches the threshold tau is finalized (at least the most
  confident one). A finished block's K/V is committed exactly by folding it into the next
  block's first pass: that pass runs [finished block, next block], and the block-causal mask
  keeps the finished block from seeing the new one, so its K/V are what a separate pass would
  give.
- fast_dllm (Fast-dLLM's prefix cache, for a bidirectional model): the sequence is prompt plus
  the whole masked answer; at each block start one full pass refreshes the cache of everything
  before the block; later steps run [current block .. end] against that (approximate) cache.
  Threshold decoding as above.
- vanilla (the DLM's own decoding): a full bidirectional pass over prompt plus the whole answer
  at every step, one token per step, so steps = answer length.

Dream predicts token i from hidden state i-1 ("shifted" logits). A block's first position is
predicted from the position before it, which a block-only pass does not run; that logit row is
kept from the pass that last computed it (the prefill, the folded commit, or the refresh).

Generation ends when every position before the first end-of-text token is final (tokens after
it are dropped, finish "stop"), or when the first max_tokens positions are (finish "length");
the internal budget is max_tokens rounded up to whole blocks. Requests join and leave between
steps; the sequences of one decoding mode run as one padded batch, one forward per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from engine.interface import EngineOutput
from engine.sampling import _top_p_filter, make_generator
from engine.text_output import TextAssembler
from models.attention import AttentionPattern
from models.kv_cache import KVCache
from models.transformer import Transformer

if TYPE_CHECKING:
    from engine.session_store import Session

Decoding = Literal["cdlm", "fast_dllm", "vanilla"]
DECODINGS: tuple[Decoding, ...] = ("cdlm", "fast_dllm", "vanilla")


@dataclass(slots=True)
class DLMParams:
    max_tokens: int
    decoding: Decoding = "cdlm"
    block_size: int = 32
    threshold: float = 0.9
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(eq=False, slots=True)
class DLMSequence:
    id: str
    prompt: list[int]
    params: DLMParams
    answer: Tensor  # [gen_len] int64, mask id where not yet final
    text: TextAssembler
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    block: int = 0  # index of the block being decoded
    steps: int = 0
    row: int = -1  # row in its mode's KV cache (cdlm, fast_dllm)
    pending_commit: bool = False  # cdlm: the previous block is final but not yet cached
    refresh: bool = True  # fast_dllm: the next pass is a full refresh
    carry: Tensor | None = None  # [V] logits predicting the block's first token (Dream)
    emitted: int = 0  # answer tokens already handed out
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    tokens_per_step: list[int] = field(default_factory=list)
    aborted: Callable[[], bool] = lambda: False

    @property
    def size(self) -> int:
        return self.params.block_size

    @property
    def gen_len(self) -> int:
        return self.answer.shape[0]

    @property
    def block_start(self) -> int:
        """Answer index of the current block's first token."""
        return self.block * self.size


@dataclass(slots=True)
class _Row:
    """One sequence's slice of a batched forward."""

    seq: DLMSequence
    tokens: Tensor  # [Q] the tokens this pass runs
    commit: int  # how many of them become permanent in the cache
    offset: int  # query index of the current block's first token


# cdlm steps of up to this many tokens (all rows together) run through the fused C++ step.
# vanilla and fast_dllm steps (whole sequences, or a block plus every later position) stay on
# the PyTorch path: the fused attention is a plain per-query loop, and at 320 tokens it made a
# 256-token vanilla generation of the shipped teacher 1.7x slower (7.0 vs 4.1 s, bf16).
FUSED_BLOCK_TOKENS = 128


class DLMEngine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Any,
        max_model_len: int,
        max_batch: int = 8,
        default_block_size: int | None = None,
        default_threshold: float | None = None,
    ):
        cfg = model.config
        if cfg.mask_token_id is None:
            raise ValueError("a diffusion model needs a mask_token_id in its config")
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.mask_id = int(cfg.mask_token_id)
        self.shift = cfg.logits_shift
        self.block_size = default_block_size or cfg.dlm_block_size or 32
        self.threshold = (
            default_threshold
            if default_threshold is not None
            else (cfg.dlm_threshold if cfg.dlm_threshold is not None else 0.9)
        )
        eos = set(cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.running: dict[Decoding, list[DLMSequence]] = {d: [] for d in DECODINGS}
        self.waiting: list[DLMSequence] = []
        self.caches: dict[Decoding, KVCache] = {}
        self.forward_passes = 0  # every model forward this engine ran (tests check steps)
        # Called with (sequence, block logits [B, V]) at every step; for tests and tracing.
        self.on_step: Callable[[DLMSequence, Tensor], None] | None = None
        self.on_finish: Callable[[DLMSequence], None] | None = None

    # ---- requests ----------------------------------------------------------------------------
    def new_sequence(
        self,
        request_id: str,
        prompt: list[int],
        params: DLMParams,
        aborted: Callable[[], bool] = lambda: False,
        session: Session | None = None,
        append: bool = True,
    ) -> DLMSequence:
        if session is not None:
            raise ValueError("sessions are for autoregressive models")
        if not prompt:
            raise ValueError("a diffusion model needs a non-empty prompt")
        if params.block_size < 1 or params.max_tokens < 1:
            raise ValueError("block_size and max_tokens must be >= 1")
        gen_len = math.ceil(params.max_tokens / params.block_size) * params.block_size
        if len(prompt) + gen_len > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)}) + answer ({gen_len}, max_tokens rounded up to whole "
                f"blocks) exceeds the context ({self.max_model_len})"
            )
        device = self.model.device
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return DLMSequence(
            id=request_id,
            prompt=list(prompt),
            params=params,
            answer=torch.full((gen_len,), self.mask_id, dtype=torch.long, device=device),
            text=TextAssembler(self.tokenizer, list(params.stop)),
            stop_ids=frozenset(stop_ids),
            generator=None if params.temperature == 0 else make_generator(params.seed, device),
            aborted=aborted,
        )

    def add(self, seq: DLMSequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.running.values())

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return sum(len(group) for group in self.running.values())

    def kv_usage(self) -> float:
        """Fraction of the decoding modes' KV slots holding committed tokens (vanilla keeps
        no cache)."""
        slots = sum(c.batch * c.capacity for c in self.caches.values())
        return sum(sum(c.lengths) for c in self.caches.values()) / slots if slots else 0.0

    def reset(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted)."""
        self.waiting.clear()
        for group in self.running.values():
            group.clear()
        self.caches.clear()

    def generate(self, prompt: list[int], params: DLMParams) -> Iterator[EngineOutput]:
        """Decode one request alone (the engine must be otherwise idle)."""
        seq = self.new_sequence("single", prompt, params)
        self.add(seq)
        while seq.finish_reason is None:
            yield from (o for o in self.step() if o.request_id == seq.id)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        """Admit waiting requests, run one forward per decoding mode, and return what became
        final."""
        outputs: list[EngineOutput] = []
        self._admit()
        for mode in DECODINGS:
            for seq in [s for s in self.running[mode] if s.aborted()]:
                seq.finish_reason = "abort"
                outputs.append(EngineOutput(seq.id, [], "", "abort", steps=seq.steps))
                self._retire(mode, seq)
            group = self.running[mode]
            if group:
                rows = [self._plan(seq) for seq in group]
                hidden = self._forward(mode, rows)
                for i, row in enumerate(rows):
                    out = self._advance(row, hidden[i])
                    if out is not None:
                        outputs.append(out)
            for seq in [s for s in group if s.finish_reason is not None]:
                self._retire(mode, seq)
        return outputs

    def _admit(self) -> None:
        """Waiting requests join their mode's batch while it has room, in arrival order within
        a mode; a full mode never holds back requests of another (no head-of-line blocking)."""
        still_waiting = []
        for seq in self.waiting:
            mode = seq.params.decoding
            group = self.running[mode]
            if len(group) >= self.max_batch:
                still_waiting.append(seq)
                continue
            seq.row = len(group)
            group.append(seq)
            if mode == "cdlm":
                self._prefill(seq)
        self.waiting = still_waiting

    def _cache(self, mode: Decoding, capacity: int) -> KVCache:
        """The mode's KV cache: max_batch rows (row i belongs to running[mode][i]), grown to
        `capacity` slots."""
        cache = self.caches.get(mode)
        if cache is None:
            cache = self.caches[mode] = self.model.new_cache(self.max_batch, max(capacity, 64))
        cache.ensure_capacity(capacity)
        return cache

    def _prefill(self, seq: DLMSequence) -> None:
        """cdlm: run the prompt once (one bidirectional block) into the sequence's cache row."""
        p = len(seq.prompt)
        cache = self._cache("cdlm", p + seq.gen_len + 2 * seq.size)
        cache.reset(seq.row)
        ids = torch.tensor([seq.prompt], device=self.model.device)
        pattern = AttentionPattern.block_causal(seq.size, p)
        hidden = self.model(ids, cache=cache, rows=(seq.row, seq.row + 1), pattern=pattern)
        self.forward_passes += 1
        seq.steps += 1  # reported steps are forward passes, the prefill included
        if self.shift:
            seq.carry = self.model.logits(hidden[0, p - 1]).float()

    def _plan(self, seq: DLMSequence) -> _Row:
        """What this sequence runs in the next forward pass."""
        mode, size, start = seq.params.decoding, seq.size, seq.block_start
        block = seq.answer[start : start + size]
        prompt = torch.tensor(seq.prompt, device=seq.answer.device)
        if mode == "cdlm":
            if seq.pending_commit:
                done = seq.answer[start - size : start]
                return _Row(seq, torch.cat([done, block]), size, size)
            return _Row(seq, block, 0, 0)
        full = torch.cat([prompt, seq.answer])
        if mode == "fast_dllm" and not seq.refresh:
            return _Row(seq, full[len(prompt) + start :], 0, 0)
        # fast_dllm refresh (commit the prefix before the block) or vanilla (no cache).
        return _Row(seq, full, len(prompt) + start, len(prompt) + start)

    def _forward(self, mode: Decoding, rows: list[_Row]) -> Tensor:
        """One padded forward for all rows of a mode -> hidden [n, Qmax, hidden]."""
        device = self.model.device
        n, q_max = len(rows), max(r.tokens.shape[0] for r in rows)
        tokens = torch.full((n, q_max), self.mask_id, dtype=torch.long, device=device)
        valid = torch.zeros(n, q_max, dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            tokens[i, : r.tokens.shape[0]] = r.tokens
            valid[i, : r.tokens.shape[0]] = True
        padded = not bool(valid.all())
        self.forward_passes += 1
        if mode == "vanilla":
            return self.model(
                tokens, pattern=AttentionPattern.bidirectional(), valid=valid if padded else None
            )
        cache = self._cache(mode, 0)
        if mode == "cdlm" and sum(r.tokens.shape[0] for r in rows) <= FUSED_BLOCK_TOKENS:
            fused = self._fused_blocks(rows, cache)
            if fused is not None:
                return fused
        if mode == "fast_dllm":
            for r in rows:
                if r.seq.refresh:
                    cache.reset(r.seq.row)
        if mode == "fast_dllm":
            pattern = AttentionPattern.bidirectional()
        elif n == 1:  # host ints let the model skip the mask on single-block steps
            pattern = AttentionPattern.block_causal(rows[0].seq.size, len(rows[0].seq.prompt))
        else:
            pattern = AttentionPattern.block_causal(
                torch.tensor([r.seq.size for r in rows], device=device),
                torch.tensor([len(r.seq.prompt) for r in rows], device=device),
            )
        positions = torch.tensor(cache.logical[:n], device=device).view(n, 1) + torch.arange(
            q_max, device=device
        )
        # Rows 0..n-1 of the mode's cache; every row writes q_max scratch slots (its padding
        # too) after what it holds.
        return self.model(
            tokens,
            cache=cache,
            rows=(0, n),
            positions=positions,
            pattern=pattern,
            valid=valid if padded else None,
            commit=[r.commit for r in rows],
        )

    def _fused_blocks(self, rows: list[_Row], cache: KVCache) -> Tensor | None:
        """cdlm rows through the fused C++ step (bf16 on CPU): each row's new tokens (the
        block just completed, to commit, then the current one; or the current one alone) are
        block-causal, so every token attends to its row's committed slots and its own block,
        bidirectionally. Returns hidden [n, Qmax, hidden] like the padded forward (padding
        rows zero), or None where the fused kernels do not apply."""
        ids: list[int] = []
        owners: list[int] = []
        slots: list[int] = []
        attend: list[int] = []
        for r in rows:
            row, size, n = r.seq.row, r.seq.size, r.tokens.shape[0]
            base = cache.lengths[row]
            ids += r.tokens.tolist()
            owners += [row] * n
            slots += range(base, base + n)
            attend += [base + min(n, (j // size + 1) * size) for j in range(n)]
        flat = self.model.fused_tokens(ids, owners, slots, attend, cache)  # [T, hidden]
        if flat is None:
            return None
        q_max = max(r.tokens.shape[0] for r in rows)
        hidden = flat.new_zeros(len(rows), q_max, flat.shape[-1])
        start = 0
        for i, r in enumerate(rows):
            n = r.tokens.shape[0]
            hidden[i, :n] = flat[start : start + n]
            start += n
        counts = [0] * cache.batch
        for r in rows:
            counts[r.seq.row] = r.commit
        cache.commit(counts)
        return hidden

    def _block_logits(self, row: _Row, hidden: Tensor) -> Tensor:
        """[B, V] fp32 logits predicting the current block's tokens."""
        seq, size, off = row.seq, row.seq.size, row.offset
        if not self.shift:
            return self.model.logits(hidden[off : off + size]).float()
        # Dream: position j is predicted by hidden state j - 1.
        if off > 0:
            seq.carry = self.model.logits(hidden[off - 1]).float()
        rest = self.model.logits(hidden[off : off + size - 1]).float()
        assert seq.carry is not None, "no logits for the block's first position"
        return torch.cat([seq.carry[None], rest])

    def _advance(self, row: _Row, hidden: Tensor) -> EngineOutput | None:
        seq = row.seq
        seq.steps += 1
        if seq.params.decoding == "cdlm" and seq.pending_commit:
            seq.pending_commit = False
        if seq.params.decoding == "fast_dllm":
            seq.refresh = False
        logits = self._block_logits(row, hidden)
        if self.on_step is not None:
            self.on_step(seq, logits)
        start, size = seq.block_start, seq.size
        block = seq.answer[start : start + size]  # a view: updated in place
        masked = block == self.mask_id
        chosen, tokens = self._choose(seq, logits, masked)
        block[chosen] = tokens[chosen]
        seq.tokens_per_step.append(int(chosen.sum()))
        return self._after_step(seq)

    def _choose(self, seq: DLMSequence, logits: Tensor, masked: Tensor) -> tuple[Tensor, Tensor]:
        """Which masked positions to finalize this step, and with which tokens."""
        p = seq.params
        # The mask token is never an answer: a model that predicts it would leave the position
        # masked and, decoding greedily, pick it again at every step.
        logits[:, self.mask_id] = float("-inf")
        if p.temperature == 0:
            probs = torch.softmax(logits, dim=-1)
            conf, tokens = probs.max(dim=-1)
        else:
            probs = torch.softmax(logits / p.temperature, dim=-1)
            if p.top_p < 1.0:
                probs = _top_p_filter(probs, p.top_p)
            tokens = torch.multinomial(probs, 1, generator=seq.generator).squeeze(-1)
            conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
        conf = torch.where(masked, conf, torch.tensor(-1.0, device=conf.device))
        best = int(conf.argmax())
        if p.decoding == "vanilla":
            chosen = torch.zeros_like(masked)
        else:
            chosen = masked & (conf >= p.threshold)
        chosen[best] = True  # always at least the most confident masked position
        return chosen, tokens

    def _after_step(self, seq: DLMSequence) -> EngineOutput | None:
        """Emit what became final; finish once the answer is complete."""
        answer = seq.answer.tolist()
        limit = min(seq.params.max_tokens, seq.gen_len)
        stop_at = next((i for i, t in enumerate(answer[:limit]) if t in seq.stop_ids), None)
        end = limit if stop_at is None else stop_at
        first_masked = next((i for i, t in enumerate(answer) if t == self.mask_id), len(answer))
        if first_masked >= end:  # everything the answer keeps is final
            if stop_at is None:
                return self._emit(seq, answer[seq.emitted : end], "length")
            # The stop token counts as generated (as in the AR engine), but is not shown.
            return self._emit(seq, answer[seq.emitted : end + 1], "stop", hidden_last=True)
        block_end = seq.block_start + seq.size
        if first_masked >= block_end:  # block complete: hand it out and move on
            seq.block += 1
            seq.pending_commit = seq.params.decoding == "cdlm"
            seq.refresh = True
            return self._emit(seq, answer[seq.emitted : block_end], None)
        return None

    def _emit(
        self, seq: DLMSequence, ids: list[int], reason: str | None, hidden_last: bool = False
    ) -> EngineOutput:
        parts = []
        for i, t in enumerate(ids[:-1] if hidden_last else ids):
            delta = seq.text.push(t)
            parts.append(delta.text)
            if delta.stopped:  # a stop string: the text ends before it, and so does the answer
                reason = "stop"
                ids = ids[: i + 1]  # counted up to the token that completed the stop string
                break
        else:
            if reason is not None:
                parts.append(seq.text.flush())
        seq.emitted += len(ids)
        seq.finish_reason = reason
        return EngineOutput(seq.id, ids, "".join(parts), reason, steps=seq.steps)

    def _retire(self, mode: Decoding, seq: DLMSequence) -> None:
        group = self.running[mode]
        last = group[-1]
        if mode in self.caches and last is not seq:
            self.caches[mode].move_row(last.row, seq.row)
        group[seq.row] = last
        last.row = seq.row
        group.pop()
        if self.on_finish is not None:
            self.on_finish(seq)
