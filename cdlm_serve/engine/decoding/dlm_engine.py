"""Diffusion-LM decoding: CDLM and the two baselines it is measured against, batched.

All three produce the answer block by block (blocks of B tokens, left to right). Inside the
current block, masked positions are filled over several steps; each step is one forward pass.
They differ in what that pass runs over, which is each mode's own file
(`engine/decoding/dlm_modes/`): cdlm runs the current block against a KV cache of the prompt and
the finished blocks (exact, block-causal); fast_dllm runs [block .. end] against a prefix cache
refreshed at every block start; vanilla runs the whole sequence every step and finalizes one token
per step. cdlm and fast_dllm finalize every masked token whose confidence reaches the threshold tau
(at least the most confident one).

Dream predicts token i from hidden state i-1 ("shifted" logits). A block's first position is
predicted from the position before it, which a block-only pass does not run; that logit row is
kept from the pass that last computed it (the prefill, the folded commit, or the refresh).

Generation ends when every position before the first end-of-text token is final (tokens after
it are dropped, finish "stop"), or when the first max_tokens positions are (finish "length");
the internal budget is max_tokens rounded up to whole blocks. Requests join and leave between
steps; the sequences of one decoding mode run as one padded batch, one forward per step. An
answer that follows a grammar (structured outputs) commits only what its grammar accepts, left
to right: `engine/decoding/dlm_grammar.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from cdlm_serve.engine import heap, limits
from cdlm_serve.engine.decoding import dlm_grammar
from cdlm_serve.engine.decoding.dlm_modes import MODES, DecodeContext
from cdlm_serve.engine.decoding.dlm_sequence import BlockPass, DLMParams, DLMSequence
from cdlm_serve.engine.decoding.grammar import Grammars
from cdlm_serve.engine.decoding.interface import EngineOutput, FinishReason
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
from cdlm_serve.engine.decoding.request import GenerationOptions
from cdlm_serve.engine.decoding.sampling import (
    _top_p_filter,
    draw,
    eos_token_ids,
    make_generator,
    tempered_softmax,
)
from cdlm_serve.engine.decoding.scheduler import ScheduledEngine, Scheduler
from cdlm_serve.engine.decoding.text_output import TextAssembler
from cdlm_serve.engine.decoding.unmasking import (
    DREAM_ALGS,
    LLADA_REMASKING,
    Confidence,
    Schedule,
    confidence,
    origin,
    pick,
    quota,
)
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.transformer import Transformer

if TYPE_CHECKING:
    from cdlm_serve.engine.sessions import Session


class DLMEngine(ScheduledEngine[DLMSequence]):
    def __init__(
        self,
        model: Transformer,
        tokenizer: Any,
        max_model_len: int,
        max_batch: int = 8,
        default_block_size: int | None = None,
        default_threshold: float | None = None,
        batch_invariant: bool = False,
    ):
        cfg = model.config
        if cfg.mask_token_id is None:
            raise ValueError("a diffusion model needs a mask_token_id in its config")
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.mask_id = int(cfg.mask_token_id)
        self.shift = cfg.logits_shift
        # How a fixed number of steps is spread over a block: Dream's way for Dream checkpoints,
        # LLaDA's for LLaDA's and ours (our students are LLaDA-format).
        self.schedule: Schedule = "dream" if cfg.family == "dream" else "llada"
        self.block_size = default_block_size or cfg.dlm_block_size or 32
        self.threshold = (
            default_threshold
            if default_threshold is not None
            else (cfg.dlm_threshold if cfg.dlm_threshold is not None else 0.9)
        )
        self.eos_token_ids = eos_token_ids(cfg.eos_token_ids, tokenizer)
        self.grammars = Grammars(tokenizer, cfg.vocab_size)  # structured outputs
        # Which positions a step may finalize under a grammar (engine.decoding.dlm_grammar).
        self.grammar_order: dlm_grammar.GrammarOrder = "any"
        # No prefix caching: a mode's prompt KV lives in its own batch cache, row by row.
        self.prefix_cache: PrefixCache | None = None
        # One batch (scheduler group) per decoding mode, each with its own KV cache.
        self.scheduler: Scheduler[DLMSequence] = Scheduler(
            max_batch,
            group_of=lambda seq: seq.params.decoding,
            abort_output=lambda seq: EngineOutput(seq.id, [], "", "abort", steps=seq.steps),
            move_row=self._move_row,
        )
        self.caches: dict[str, KVCache] = {}
        self._scratch: KVCache | None = None  # see scratch_cache
        self.forward_passes = 0  # every model forward this engine ran (tests check steps)
        # Called with (sequence, block logits [B, V]) at every step; for tests and tracing.
        self.on_step: Callable[[DLMSequence, Tensor], None] | None = None
        self.context = DecodeContext(
            runner=ModelRunner(model, batch_invariant),  # a block's bits never its batch's
            mask_id=self.mask_id,
            shift=self.shift,
            schedule=self.schedule,
            cache=self.cache_for,
            scratch=self.scratch_cache,
            count_forward=self._count_forward,
        )

    # ---- requests ----------------------------------------------------------------------------
    def params(self, options: GenerationOptions, max_tokens: int, seed: int | None) -> DLMParams:
        """A request's diffusion parameters, this engine's block size and threshold where it
        sets none. Greedy unless the request sets a temperature itself; the reference
        releases' options (`steps`, `alg`, `remasking`) mean their decoder, vanilla, unless
        the request names another. LimitError for `alg` with `remasking` (alternatives)."""
        if options.alg is not None and options.remasking is not None:
            raise limits.LimitError(
                limits.LimitProblem("alg (Dream's) and remasking (LLaDA's) are alternatives", "alg")
            )
        reference = options.steps is not None or options.alg is not None
        reference = reference or options.remasking is not None
        return DLMParams(
            max_tokens=max_tokens,
            decoding=options.decoding or ("vanilla" if reference else "cdlm"),
            block_size=options.block_size or self.block_size,
            threshold=self.threshold if options.threshold is None else options.threshold,
            temperature=0.0 if options.temperature is None else options.temperature,
            top_p=options.top_p,
            seed=seed,
            stop=list(options.stop),
            ignore_eos=options.ignore_eos,
            steps=options.steps,
            confidence=_confidence(options),
            alg_temp=options.alg_temp or 0.0,
            grammar=self.grammars.for_request(options.grammar),
        )

    def problem(
        self, prompt: int, params: DLMParams, history: int = 0
    ) -> limits.LimitProblem | None:
        """The prompt and the answer rounded up to whole blocks must fit the context, and a
        fixed number of steps must divide over the blocks. (No session: no `history`.)"""
        return limits.dlm_problem(
            prompt, params.max_tokens, params.block_size, params.steps, self.max_model_len
        )

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
        mode = MODES.get(params.decoding)
        if mode is None:
            raise ValueError(f"decoding must be one of {sorted(MODES)}, not {params.decoding!r}")
        problem = self.problem(len(prompt), params)
        if problem is not None:
            raise ValueError(problem.message)
        gen_len = limits.dlm_answer_length(params.max_tokens, params.block_size)
        device = self.model.device
        return DLMSequence(
            id=request_id,
            prompt=list(prompt),
            params=params,
            tokens=torch.cat(
                [
                    torch.tensor(prompt, dtype=torch.long, device=device),
                    torch.full((gen_len,), self.mask_id, dtype=torch.long, device=device),
                ]
            ),
            text=TextAssembler(self.tokenizer, list(params.stop)),
            stop_ids=params.stop_ids(self.eos_token_ids),
            generator=make_generator(params.seed, device) if _draws(params) else None,
            state=mode.new_state(),
            aborted=aborted,
        )

    @property
    def running(self) -> dict[str, list[DLMSequence]]:
        """The running sequences per decoding mode; row i of a mode's cache is its [i]."""
        return self.scheduler.running

    @property
    def waiting(self) -> list[DLMSequence]:
        return self.scheduler.waiting

    def kv_bytes(self) -> int:
        caches = [*self.caches.values(), *([self._scratch] if self._scratch is not None else [])]
        return sum(c.allocated_bytes() for c in caches)

    def release_idle(self) -> None:
        if self.scheduler.has_work():
            return
        heap.freed(self.kv_bytes())
        self.caches.clear()
        self._scratch = None

    def kv_usage(self) -> float:
        """Fraction of the decoding modes' KV slots holding committed tokens (vanilla keeps
        no cache)."""
        slots = sum(c.batch * c.capacity for c in self.caches.values())
        return sum(sum(c.lengths) for c in self.caches.values()) / slots if slots else 0.0

    def reset(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted)."""
        self.scheduler.reset()
        self.caches.clear()
        self._scratch = None

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
        for name, joined in self.scheduler.schedule(outputs).items():
            MODES[name].admit(self.context, joined)
        for name, group in self.running.items():
            if not group:
                continue
            mode = MODES[name]
            passes = [mode.plan(seq) for seq in group]
            # The grammar rows' masks at their frontiers (their matchers do not move until
            # their own _advance); none computed where no row follows a grammar.
            allowed = dlm_grammar.frontier_masks(
                group, self.model.config.vocab_size, self.model.device
            )
            hidden = mode.forward(self.context, passes)  # [n, Qmax, hidden]
            self._count_forward()
            for i, block_pass in enumerate(passes):
                out = self._advance(block_pass, hidden[i], allowed.get(i))
                if out is not None:
                    outputs.append(out)
        self.scheduler.retire_finished()
        return outputs

    def _count_forward(self) -> None:
        self.forward_passes += 1

    def cache_for(self, mode: str, capacity: int) -> KVCache:
        """The mode's KV cache: max_batch rows (row i belongs to running[mode][i]), grown to
        `capacity` slots."""
        cache = self.caches.get(mode)
        if cache is None:
            cache = self.caches[mode] = self.model.new_cache(self.max_batch, max(capacity, 64))
        cache.ensure_capacity(capacity)
        return cache

    def scratch_cache(self, capacity: int) -> KVCache:
        """max_batch rows of at least `capacity` slots for passes that commit nothing (vanilla
        through the fused step, which reads K/V from a cache); not counted as KV use."""
        if self._scratch is None:
            self._scratch = self.model.new_cache(self.max_batch, max(capacity, 64))
        self._scratch.ensure_capacity(capacity)
        return self._scratch

    def _block_logits(self, block_pass: BlockPass, hidden: Tensor) -> Tensor:
        """[B, V] fp32 logits predicting the current block's tokens."""
        seq, size, off = block_pass.seq, block_pass.seq.block_size, block_pass.offset
        if not self.shift:
            return self.model.logits(hidden[off : off + size]).float()
        # Dream: position j is predicted by hidden state j - 1.
        if off > 0:
            seq.first_logits = self.model.logits(hidden[off - 1]).float()
        rest = self.model.logits(hidden[off : off + size - 1]).float()
        assert seq.first_logits is not None, "no logits for the block's first position"
        return torch.cat([seq.first_logits[None], rest])

    def _advance(
        self, block_pass: BlockPass, hidden: Tensor, allowed: Tensor | None = None
    ) -> EngineOutput | None:
        """One sequence's step after the forward; `allowed` [V]: the tokens its grammar allows
        at its frontier (None: it follows none)."""
        seq = block_pass.seq
        seq.steps += 1
        seq.block_steps += 1
        MODES[seq.params.decoding].after_pass(seq)
        logits = self._block_logits(block_pass, hidden)
        if self.on_step is not None:
            self.on_step(seq, logits)
        start, size = seq.block_start, seq.block_size
        block = seq.answer[start : start + size]  # a view: updated in place
        masked = block == self.mask_id
        if allowed is None:
            chosen, tokens = self._choose(seq, logits, masked)
            block[chosen] = tokens[chosen]
            seq.tokens_per_step.append(int(chosen.sum()))
            return self._after_step(seq)
        frontier = seq.grammar_checked - start  # the block's first masked position
        logits = logits.clone()
        logits[frontier] = logits[frontier].masked_fill(~allowed, float("-inf"))
        chosen, tokens = self._choose(seq, logits, masked)
        if self.grammar_order == "leftmost":
            chosen = dlm_grammar.leftmost_run(chosen, frontier)
        block[chosen] = tokens[chosen]
        limit = min(seq.params.max_tokens, seq.gen_len)
        refused = dlm_grammar.check(seq, self.mask_id, limit, self.grammar_order)
        seq.tokens_per_step.append(int(chosen.sum()) - refused)
        return self._after_step(seq)

    def _choose(self, seq: DLMSequence, logits: Tensor, masked: Tensor) -> tuple[Tensor, Tensor]:
        """Which masked positions to finalize this step, and with which tokens.
        logits [B, V] fp32, masked [B] -> (chosen [B] bool, tokens [B])."""
        p = seq.params
        t = p.temperature  # tempered_softmax: no t > 0 a request can send makes it NaN
        probs = torch.softmax(logits, dim=-1) if t == 0 else tempered_softmax(logits, t)
        # The mask token is never an answer: a model that predicts it would leave the position
        # masked (the references let it be chosen and stay masked). It is left in `probs`, so
        # confidences are normalized over the whole vocabulary as theirs are.
        allowed = probs.clone()
        allowed[:, self.mask_id] = 0
        if p.temperature == 0:
            tokens = allowed.argmax(dim=-1)
        else:
            allowed = allowed / allowed.sum(dim=-1, keepdim=True)
            if p.top_p < 1.0:
                allowed = _top_p_filter(allowed, p.top_p)
            tokens = draw(allowed, seq.generator)
        draws = None
        if p.confidence == "random":  # LLaDA draws over the whole sequence, then takes the block
            full = torch.rand(
                len(seq.prompt) + seq.gen_len, generator=seq.generator, device=logits.device
            )
            start = len(seq.prompt) + seq.block_start
            draws = full[start : start + seq.block_size]
        spb = (p.steps or seq.gen_len) // (seq.gen_len // seq.block_size)  # steps per block
        step = seq.block_steps - 1  # this step's index in its block
        if p.confidence == "origin":
            return origin(masked, step, spb, seq.generator), tokens
        forced = MODES[p.decoding].forced_choice(self.context, seq, masked, step)
        if forced is not None:
            return forced, tokens
        conf = confidence(p.confidence, probs, tokens, draws)
        conf = torch.where(masked, conf, torch.tensor(float("-inf"), device=conf.device))
        if p.steps is not None:  # a fixed schedule
            k = quota(self.schedule, int(masked.sum()), seq.block_size, step, spb)
            return pick(conf, k, p.alg_temp, seq.generator), tokens
        if MODES[p.decoding].parallel:
            chosen = masked & (conf >= p.threshold)
        else:
            chosen = torch.zeros_like(masked)
        chosen[int(conf.argmax())] = True  # always at least the most confident masked position
        return chosen, tokens

    def _after_step(self, seq: DLMSequence) -> EngineOutput | None:
        """Emit what became final; finish once the answer is complete."""
        answer = seq.answer.tolist()
        if seq.grammar_end is not None:  # the grammar ended the answer (dlm_grammar.check)
            seq.steps_per_block.append(seq.block_steps)
            end = seq.grammar_end
            if end < len(answer) and answer[end] in seq.stop_ids:  # counted, not shown
                return self._emit(seq, answer[seq.emitted : end + 1], "stop", hidden_last=True)
            return self._emit(seq, answer[seq.emitted : end], "stop")
        limit = min(seq.params.max_tokens, seq.gen_len)
        stop_at = next((i for i, t in enumerate(answer[:limit]) if t in seq.stop_ids), None)
        end = limit if stop_at is None else stop_at
        first_masked = next((i for i, t in enumerate(answer) if t == self.mask_id), len(answer))
        if first_masked >= end:  # everything the answer keeps is final
            seq.steps_per_block.append(seq.block_steps)
            if stop_at is None:
                return self._emit(seq, answer[seq.emitted : end], "length")
            # The stop token counts as generated (as in the AR engine), but is not shown.
            return self._emit(seq, answer[seq.emitted : end + 1], "stop", hidden_last=True)
        block_end = seq.block_start + seq.block_size
        if first_masked >= block_end:  # block complete: hand it out and move on
            seq.block += 1
            seq.steps_per_block.append(seq.block_steps)
            seq.block_steps = 0
            MODES[seq.params.decoding].next_block(seq)
            return self._emit(seq, answer[seq.emitted : block_end], None)
        return None

    def _emit(
        self,
        seq: DLMSequence,
        ids: list[int],
        reason: FinishReason | None,
        hidden_last: bool = False,
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

    def _move_row(self, mode: str, src: int, dst: int) -> None:
        if mode in self.caches:
            self.caches[mode].move_row(src, dst)


def _draws(params: DLMParams) -> bool:
    """Whether decoding draws random numbers (and so needs the request's generator)."""
    drawn = params.confidence in ("random", "origin")
    return params.temperature > 0 or drawn or params.alg_temp > 0


def _confidence(options: GenerationOptions) -> Confidence:
    """How sure a step is of each masked position, in Dream's words (`alg`) or LLaDA's
    (`remasking`, low_confidence by default); LimitError for a name neither knows."""
    names, name, param = DREAM_ALGS, options.alg, "alg"
    if name is None:
        names, name, param = LLADA_REMASKING, options.remasking or "low_confidence", "remasking"
    if name not in names:
        raise limits.LimitError(
            limits.LimitProblem(f"{param} must be one of {', '.join(names)}, not {name!r}", param)
        )
    return names[name]
