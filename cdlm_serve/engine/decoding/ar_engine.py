"""Autoregressive generation with continuous batching.

Each running sequence owns one row of a shared KV cache (rows, admission, aborts and retiring:
`engine.decoding.scheduler`). A step hands the model one token for every decoding sequence and
chunks of the prompts still being prefilled (`prefill_tokens` per step at most: chunked prefill, so
a long prompt never stalls the others for more than one chunk), in one call
(`ModelRunner.extend_tokens`, which picks the fused CPU step or the PyTorch path), and samples a
token for every decoding row and every prompt just completed. A sequence may continue from a
session's cache (copied into its row when it is admitted) and write its answer back into it;
one of `max_tokens` 0 only prefills its prompt (a new session's, through the same chunks and
step budget as every prompt). A prompt's own logprobs are scored as its chunks run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from cdlm_serve.engine import heap, limits
from cdlm_serve.engine.decoding.grammar import Grammars, MaskFill
from cdlm_serve.engine.decoding.interface import EngineOutput, TokenLogprob
from cdlm_serve.engine.decoding.model_runner import ModelRunner, last_tokens
from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
from cdlm_serve.engine.decoding.request import GenerationOptions
from cdlm_serve.engine.decoding.sampling import (
    Adjusted,
    SamplingParams,
    adjust_logits,
    eos_token_ids,
    make_generator,
    sample,
)
from cdlm_serve.engine.decoding.scheduler import ScheduledEngine, Scheduler
from cdlm_serve.engine.decoding.text_output import TextAssembler
from cdlm_serve.models import kernels
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.transformer import Transformer

if TYPE_CHECKING:
    from cdlm_serve.engine.sessions import Session


@dataclass(eq=False, slots=True)
class ARSequence:
    id: str
    prompt: list[int]
    params: SamplingParams
    budget: int
    text: TextAssembler
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    aborted: Callable[[], bool] = lambda: False
    # Continue from a session's cache (engine.sessions.store.Session); with `append`, the prompt and
    # the answer are written back into the session when the sequence finishes.
    session: Session | None = None
    append: bool = True
    row: int = -1
    compacted: bool = False  # its row holds a compacted segment (per-key biases)
    prefilled: int = 0  # prompt tokens already in the cache (long prompts join in chunks)
    next_input: int | None = None  # the last sampled token: the next step runs it
    generated: int = 0
    run_tokens: list[int] = field(default_factory=list)  # sampled tokens already in the cache
    last_token: int | None = None  # the final sampled token (never run), once finished
    finish_reason: str | None = None
    cached: int = 0  # prompt tokens loaded from the prefix cache instead of prefilled
    # The prompt's logprobs so far (tokens 1.. of the prompt), when its params ask for them.
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)  # answer tokens, for the penalties
    # Timing, for metrics (perf_counter seconds).
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # set by the scheduler
    token_times: list[float] = field(default_factory=list)


INITIAL_SLOTS = 256  # per row of a new batch cache; it grows for longer rows
GROWTH_HEADROOM = 256  # answer tokens a new row gets room for when the cache grows for it
# Prompt tokens one step prefills, all new rows together (chunked prefill). A longer prompt
# joins over several steps, and the running rows decode at every one of them.
PREFILL_TOKENS_PER_STEP = 512
ROWS = "rows"  # the scheduler's one group: every sequence shares the batch cache


def _adjusting(seqs: list[ARSequence], chunks: list[tuple[int, list[int]]]) -> list[int]:
    """The rows of a step whose logits the request adjusts (penalties, biases, a grammar),
    of those that draw a token this step (a decode step, or a prompt's last chunk)."""
    return [
        i
        for i, (seq, (_, tokens)) in enumerate(zip(seqs, chunks, strict=True))
        if seq.params.adjusts_logits and seq.prefilled + len(tokens) >= len(seq.prompt)
    ]


def _session_slots(seq: ARSequence) -> int:
    """Committed slots of the session a sequence continues from (0 without one)."""
    cache = None if seq.session is None else seq.session.cache
    return 0 if cache is None else cache.lengths[0]


class AREngine(ScheduledEngine[ARSequence]):
    def __init__(
        self,
        model: Transformer,
        tokenizer: Any,
        max_model_len: int,
        max_batch: int = 8,
        prefill_tokens: int = PREFILL_TOKENS_PER_STEP,
        prefix_cache: PrefixCache | None = None,
        batch_invariant: bool = False,
    ):
        self.model = model
        # Automatic prefix caching (engine.decoding.prefix_cache); None turns it off. Off for models
        # with sliding-window layers: it keeps blocks of global slots, not the ring a block's
        # window needs (`models.window_cache`).
        self.prefix_cache = None if model.config.local_layers else prefix_cache
        # Batch-invariant: a row's bits never depend on its neighbours (`ModelRunner`).
        self.runner = ModelRunner(model, batch_invariant)
        self.prefill_tokens = prefill_tokens
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids(model.config.eos_token_ids, tokenizer)
        self.grammars = Grammars(tokenizer, model.config.vocab_size)  # structured outputs
        self.scheduler: Scheduler[ARSequence] = Scheduler(
            max_batch,
            group_of=lambda seq: ROWS,
            abort_output=lambda seq: EngineOutput(seq.id, [], "", "abort"),
            move_row=self._move_row,
            release=self._release,
        )
        self.cache: KVCache | None = None
        # Build the fused CPU decode step now (it packs a copy of the weights, ~0.5 s for
        # SmolLM2) rather than inside the first request; None where it does not apply.
        self.runner.stack()

    # ---- requests --------------------------------------------------------------------------
    def params(
        self, options: GenerationOptions, max_tokens: int, seed: int | None
    ) -> SamplingParams:
        """A request's sampling parameters: OpenAI's defaults (temperature 1) where it sets
        none. The diffusion options are not this engine's (the server refuses them first)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if options.temperature is None else options.temperature,
            top_p=options.top_p,
            seed=seed,
            stop=list(options.stop),
            logprobs=options.logprobs,
            prompt_logprobs=options.prompt_logprobs,
            ignore_eos=options.ignore_eos,
            cache_salt=options.cache_salt,
            presence_penalty=options.presence_penalty or 0.0,
            frequency_penalty=options.frequency_penalty or 0.0,
            repetition_penalty=options.repetition_penalty or 1.0,
            logit_bias=dict(options.logit_bias or {}),
            min_p=options.min_p or 0.0,
            grammar=self.grammars.for_request(options.grammar),
        )

    def problem(
        self, prompt: int, params: SamplingParams, history: int = 0
    ) -> limits.LimitProblem | None:
        """The context must hold the prompt after the session's `history` and one answer
        token (a prefill's too, of max_tokens 0: it asks for none, but must leave room for
        one); a longer answer is cut to the context (`clamp`)."""
        wanted = params.max_tokens or None
        vocab = self.model.config.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            return limits.LimitProblem(
                f"logit_bias names token id {bad}, outside the vocabulary [0, {vocab})",
                "logit_bias",
            )
        return limits.ar_problem(prompt, wanted, history, self.max_model_len, clamp=True)

    def new_sequence(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        aborted: Callable[[], bool] = lambda: False,
        session: Session | None = None,
        append: bool = True,
    ) -> ARSequence:
        history = 0 if session is None else session.logical_length
        problem = self.problem(len(prompt), params, history)
        if problem is not None:
            raise ValueError(problem.message)
        budget = min(params.max_tokens, self.max_model_len - history - len(prompt))
        generator = None if params.greedy else make_generator(params.seed, self.model.device)
        return ARSequence(
            id=request_id,
            prompt=list(prompt),
            params=params,
            budget=budget,
            text=TextAssembler(self.tokenizer, list(params.stop)),
            stop_ids=params.stop_ids(self.eos_token_ids),
            generator=generator,
            aborted=aborted,
            session=session,
            append=append,
        )

    def reset(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted)."""
        self.scheduler.reset()
        self.cache = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def running(self) -> list[ARSequence]:
        """The running sequences; row i is running[i]."""
        return self.scheduler.group(ROWS)

    def kv_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.allocated_bytes()

    def kv_usage(self) -> float:
        """Fraction of the allocated KV slots that hold committed tokens."""
        if self.cache is None:
            return 0.0
        return sum(self.cache.lengths) / (self.cache.batch * self.cache.capacity)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        aborted: Callable[[], bool] = lambda: False,
    ) -> Iterator[EngineOutput]:
        """One request alone (the engine must be otherwise idle); yields its outputs."""
        seq = self.new_sequence("single", prompt_ids, params, aborted)
        self.add(seq)
        while self.has_work():
            yield from (o for o in self.step() if o.request_id == seq.id)

    # ---- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        joined = self.scheduler.schedule(outputs).get(ROWS, [])
        if joined:
            self._load_rows(joined)
        if self.running:
            assert self.cache is not None  # every running row has one
            seqs, chunks = self._plan()
            rows = _adjusting(seqs, chunks)
            ruled = [i for i in rows if seqs[i].params.grammar is not None]
            # Their grammar masks, filled while the model runs.
            masks = MaskFill([seqs[i].params.grammar for i in ruled], self.grammars.vocab_size)
            try:
                hidden = self.runner.extend_tokens(chunks, self.cache)  # [T, hidden]
                last = last_tokens(chunks)  # where each chunk ends in `hidden`
                logits = self.model.logits(hidden[last])  # [len(chunks), V]
                drawn = self._adjusted(seqs, rows, ruled, logits, masks)  # drawn from
            finally:
                masks.wait()  # no matcher advances while its mask is being filled
            for i, (seq, (_, tokens)) in enumerate(zip(seqs, chunks, strict=True)):
                if seq.prefilled < len(seq.prompt):
                    if seq.params.prompt_logprobs is not None:
                        self._score_prompt(seq, hidden[last[i] + 1 - len(tokens) : last[i] + 1])
                    seq.prefilled += len(tokens)
                    self._keep_prefix(seq, seq.prompt[: seq.prefilled], len(tokens))
                    if seq.prefilled < len(seq.prompt):
                        continue
                    if seq.budget == 0:  # a prefill: the prompt is in, nothing to sample
                        outputs.append(self._finish(seq, EngineOutput(seq.id, [], "", "length")))
                        continue
                # A decode step, or the prompt is in: the next token.
                outputs.append(self._accept(seq, logits[i], drawn[i]))
        self.scheduler.retire_finished()
        self._shed()
        return outputs

    def _cache_for(self, needed: int) -> KVCache:
        if self.cache is None:
            self.cache = self.model.new_cache(self.max_batch, max(needed, INITIAL_SLOTS))
        self.cache.ensure_capacity(needed)  # grow the parent: row views share its buffers
        return self.cache

    def _plan(self) -> tuple[list[ARSequence], list[tuple[int, list[int]]]]:
        """This step's work, as (sequence, (row, tokens)) pairs: one token for every decoding
        row, and prompt chunks, oldest first, up to `prefill_tokens` together (chunked
        prefill: a long prompt joins over several steps, so decoding rows never wait for more
        than one chunk)."""
        seqs: list[ARSequence] = []
        chunks: list[tuple[int, list[int]]] = []
        for seq in self.running:
            if seq.prefilled == len(seq.prompt):
                assert seq.next_input is not None
                seqs.append(seq)
                chunks.append((seq.row, [seq.next_input]))
        budget = self.prefill_tokens
        for seq in self.running:
            todo = len(seq.prompt) - seq.prefilled
            if todo and budget > 0:
                n = min(todo, budget)
                seqs.append(seq)
                chunks.append((seq.row, seq.prompt[seq.prefilled : seq.prefilled + n]))
                budget -= n
        return seqs, chunks

    def _load_rows(self, new: list[ARSequence]) -> None:
        """Rows for sequences that just joined: fresh, or loaded from their session (their
        prompts are prefilled by the coming steps)."""
        # Room for the prompts and some of the answers: growing the batch cache copies every
        # row, so a row that would grow again a few tokens later is given headroom now.
        cache = self._cache_for(
            max(_session_slots(s) + len(s.prompt) + min(s.budget, GROWTH_HEADROOM) for s in new)
        )
        for seq in new:
            if _session_slots(seq):  # continue from the session's (maybe compacted) cache
                assert seq.session is not None and seq.session.cache is not None
                cache.load_row(seq.row, seq.session.cache)
                seq.compacted = seq.session.cache.biases is not None
            elif (
                self.prefix_cache is not None
                and seq.session is None
                and seq.params.prompt_logprobs is None  # every prompt token is scored
            ):
                blocks = self.prefix_cache.match(seq.prompt, seq.params.cache_salt)
                seq.cached = seq.prefilled = self.prefix_cache.load(blocks, cache, seq.row)
            else:
                cache.reset(seq.row)

    def _keep_prefix(self, seq: ARSequence, tokens: list[int], added: int) -> None:
        """Offer the row's full blocks to the prefix cache once `added` tokens completed at
        least one more (`tokens` are the row's committed slots; sessions keep their own)."""
        pc, cache = self.prefix_cache, self.cache
        if pc is None or seq.session is not None or cache is None:
            return
        if cache.logical[seq.row] != cache.lengths[seq.row]:
            return  # not its tokens at their own positions: an optimization never fails a step
        if len(tokens) // pc.block > (len(tokens) - added) // pc.block:
            pc.insert(tokens, cache, seq.row, seq.params.cache_salt)

    def _adjusted(
        self,
        seqs: list[ARSequence],
        rows: list[int],
        ruled: list[int],
        logits: Tensor,
        masks: MaskFill,
    ) -> Tensor:
        """The step's logits [n, V] with the penalties and biases of the `rows` that ask for
        them (`_adjusting`), all such rows in one pass, and then the grammar masks of the
        `ruled` ones; the logits themselves when no row asks (the usual step pays nothing)."""
        if not rows:
            return logits
        adjusted = logits.to(torch.float32, copy=True)  # [n, V]
        biased = [i for i in rows if seqs[i].params.biases_logits]
        if biased:
            adjusted[biased] = adjust_logits(
                logits[biased],
                [Adjusted(seqs[i].params, seqs[i].prompt, seqs[i].counts) for i in biased],
            )
        if ruled:
            bans = masks.bans(logits.shape[-1], logits.device)  # [k, V]: 0 or -inf
            if len(ruled) == len(adjusted):  # every row (`ruled` is in order)
                adjusted += bans
            else:
                at = torch.tensor(ruled, device=logits.device)
                adjusted.index_add_(0, at, bans)
        return adjusted

    def _sample(self, seq: ARSequence, logits: Tensor) -> int:
        if seq.params.greedy:
            return int(kernels.argmax(logits[None])[0])
        return int(sample(logits[None], seq.params, seq.generator)[0])

    def _accept(self, seq: ARSequence, logits: Tensor, drawn: Tensor) -> EngineOutput:
        """Sample the next token of `seq` from `drawn` (its logits [V] as the request adjusted
        them) and say what it adds; its logprobs are the model's own (`logits`), as vLLM
        reports them by default."""
        token = self._sample(seq, drawn)
        seq.counts[token] = seq.counts.get(token, 0) + 1
        if seq.next_input is not None:  # the previous token has just been run through the model
            seq.run_tokens.append(seq.next_input)
        seq.last_token = token
        seq.generated += 1
        seq.token_times.append(time.perf_counter())
        lps = (
            [self._logprob(logits, token, seq.params.logprobs)]
            if seq.params.logprobs is not None
            else []
        )
        if token in seq.stop_ids:
            # Counted as generated (as OpenAI and vLLM do), never shown as text.
            return self._finish(seq, EngineOutput(seq.id, [token], seq.text.flush(), "stop", lps))
        delta = seq.text.push(token)
        grammar = seq.params.grammar
        if grammar is not None and (not grammar.consume_token(token) or grammar.is_stopped()):
            # The grammar is complete (nothing may follow but the end), or the token broke it
            # (a mask cannot let one through: then the answer ends where it still held).
            out = EngineOutput(seq.id, [token], delta.text + seq.text.flush(), "stop", lps)
            return self._finish(seq, out)
        if delta.stopped:
            return self._finish(seq, EngineOutput(seq.id, [token], delta.text, "stop", lps))
        if seq.generated >= seq.budget:
            out = EngineOutput(seq.id, [token], delta.text + seq.text.flush(), "length", lps)
            return self._finish(seq, out)
        seq.next_input = token
        return self._first(seq, EngineOutput(seq.id, [token], delta.text, None, lps))

    def _score_prompt(self, seq: ARSequence, hidden: Tensor) -> None:
        """The logprobs of the prompt tokens this chunk predicts: row i of `hidden` [C, hidden]
        (prompt position prefilled + i) predicts the next prompt token, if there is one."""
        top_k = seq.params.prompt_logprobs
        assert top_k is not None
        nxt = seq.prompt[seq.prefilled + 1 : seq.prefilled + 1 + hidden.shape[0]]
        logits = self.model.logits(hidden[: len(nxt)])  # [<=C, V]
        seq.prompt_scores += [
            self._logprob(row, tok, top_k) for row, tok in zip(logits, nxt, strict=True)
        ]

    @staticmethod
    def _logprob(logits: Tensor, token: int, top_k: int) -> TokenLogprob:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = []
        if top_k > 0:
            values, ids = logp.topk(top_k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token, float(logp[token]), top)

    def _write_back(self, seq: ARSequence) -> None:
        """The session now holds the prompt and the answer. The last sampled token was never
        run through the model: it stays the session's next input, run first by the next
        request."""
        assert self.cache is not None and seq.session is not None  # _release checked the session
        # A normal tensor, not an inference one (step() runs in inference mode): a later
        # compaction writes into the session's cache in place.
        with torch.inference_mode(False):
            cache = self.cache.extract_row(seq.row)
        if not seq.compacted:
            cache.biases = None  # other rows' segments made the batch carry (zero) biases
        seq.session.extend(cache, seq.prompt + seq.run_tokens, seq.last_token)

    def _finish(self, seq: ARSequence, out: EngineOutput) -> EngineOutput:
        seq.finish_reason = out.finish_reason
        out.cached_tokens = seq.cached
        return self._first(seq, out)

    @staticmethod
    def _first(seq: ARSequence, out: EngineOutput) -> EngineOutput:
        """The sequence's first output carries its prompt's logprobs, if it asked for them."""
        if seq.params.prompt_logprobs is not None and seq.generated <= 1:
            out.prompt_logprobs = seq.prompt_scores
        return out

    def _release(self, seq: ARSequence) -> None:
        if seq.session is not None and seq.append and seq.finish_reason in ("stop", "length"):
            self._write_back(seq)
        if seq.prefilled == len(seq.prompt) and seq.run_tokens:
            # The answer's blocks too: a chat's next turn starts with this whole exchange.
            self._keep_prefix(seq, seq.prompt + seq.run_tokens, len(seq.run_tokens))

    def _move_row(self, group: str, src: int, dst: int) -> None:
        if self.cache is not None:
            self.cache.move_row(src, dst)

    def _shed(self) -> None:
        """Leave nothing behind that later steps would pay for: the per-key biases once no
        row holds a compacted segment (every step would add them, through a float mask or the
        kernel's bias path), and, once idle, a cache grown past its first size for a long
        prompt or session (its memory). (A window layer's ring stays as a prompt's chunk grew
        it: at most window + prefill_tokens slots a row, and trimming it each time the engine
        idles would copy it back and forth between requests.)"""
        if self.cache is None:
            return
        if self.cache.biases is not None and not any(s.compacted for s in self.running):
            self.cache.biases = None  # the other rows' biases are all zero: exact
        if self.cache.capacity <= INITIAL_SLOTS:
            return
        if not self.scheduler.has_work():
            self.release_idle()
        elif self.running:
            self._shrink_to_running()

    def release_idle(self) -> None:
        if self.cache is not None and not self.scheduler.has_work():
            heap.freed(self.cache.allocated_bytes())  # on CPU, glibc keeps it unless trimmed
            self.cache = None

    def _shrink_to_running(self) -> None:
        """Under a steady load the engine never idles, and a cache grown for one long prompt
        or session (every row of it: 560 MB in float32 for a 1.5K-token session on 8 rows)
        stayed that size for as long as anything ran (minutes of a soak, issue 59). Once the
        rows still running would fit in a quarter of it, cut it to twice what they need (the
        copy is one step's worth of their slots; the slack spares a cut and regrowth per
        long request)."""
        assert self.cache is not None
        need = max(
            self.cache.lengths[s.row]
            + len(s.prompt)
            - s.prefilled
            + min(s.budget - s.generated, GROWTH_HEADROOM)
            for s in self.running
        )
        target = max(INITIAL_SLOTS, 2 * need)
        if 2 * target <= self.cache.capacity:
            before = self.cache.allocated_bytes()
            self.cache.shrink(target, live=max(s.row for s in self.running) + 1)
            heap.freed(before - self.cache.allocated_bytes())
