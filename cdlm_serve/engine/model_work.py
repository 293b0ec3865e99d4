"""Model work the server needs outside decoding, cut into bounded pieces.

A session's prompt is prefilled, and an echoed prompt's logprobs are computed, in chunks of at
most `CHUNK_TOKENS` tokens (a prefill's are shorter while other requests are decoding). Each
chunk is one piece of work handed to `on_engine` (the server passes `EngineThread.run`, which
runs it on the model's engine thread between two decode steps), so a long prompt never holds
the engine for more than one chunk and never materializes logits for more than one chunk
([chunk, vocab] instead of [prompt, vocab]: 1.6 GB of fp32 for 8K tokens of a 49K vocabulary).
Run these functions from a thread that may block, never the event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.transformer import Transformer

T = TypeVar("T")
# Runs one piece of model work where the model may be used, and returns its result.
OnEngine = Callable[[Callable[[], T]], T]


def inline(fn: Callable[[], T]) -> T:
    """Run model work right here (benchmarks, tests, a model nobody else is using)."""
    return fn()


CHUNK_TOKENS = 512
# Free slots a prefilled session's cache gets past its tokens: its next turn's first tokens
# fit without growing (copying) every layer's buffers.
PREFILL_HEADROOM = 64
# While other requests of the model decode, a session's prefill goes in chunks this long: the
# AR engine's own chunked-prefill size on CPUs (`FUSED_PREFILL_TOKENS`), ~0.1-0.2 s a chunk on
# SmolLM2 against a few thousand cached tokens instead of ~0.5-1 s.
URGENT_CHUNK_TOKENS = 128


@dataclass(slots=True)
class PromptLogprob:
    token: int
    logprob: float | None  # None for the first token (nothing predicts it)
    top: list[tuple[int, float]] | None  # the top-k alternatives (token, logprob), best first


def _chunks(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + CHUNK_TOKENS] for i in range(0, len(ids), CHUNK_TOKENS)]


def prefill(
    model: Transformer,
    ids: list[int],
    on_engine: OnEngine[None] = inline,
    urgent: Callable[[], bool] = lambda: False,
) -> KVCache:
    """A fresh batch-1 cache holding `ids`, prefilled one chunk per piece of work: of
    CHUNK_TOKENS tokens, or URGENT_CHUNK_TOKENS while `urgent()` says the model's requests are
    waiting for the pieces (a chunk is that long a pause in their decoding)."""
    cache = model.new_cache(1, len(ids) + PREFILL_HEADROOM)

    # Grad and inference modes are per thread: each piece says its own. Not inference_mode:
    # the session keeps this cache and later writes to it (compaction).
    @torch.no_grad()
    def run(chunk: list[int]) -> None:
        model(torch.tensor([chunk], device=model.device), cache=cache)

    start = 0
    while start < len(ids):
        chunk = ids[start : start + (URGENT_CHUNK_TOKENS if urgent() else CHUNK_TOKENS)]
        on_engine(functools.partial(run, chunk))
        start += len(chunk)
    if cache.window is not None:
        cache.window.trim(cache.logical)  # the chunks grew the ring: back to the window
    return cache


def prompt_logprobs(
    model: Transformer,
    ids: list[int],
    top_k: int,
    on_engine: OnEngine[list[PromptLogprob]] = inline,
) -> list[PromptLogprob]:
    """Every prompt token's logprob under the model (the first has none) and the top_k
    alternatives at each position, one chunk per piece of work."""
    cache = model.new_cache(1, len(ids) + 1)
    out = [PromptLogprob(ids[0], None, None)]

    @torch.inference_mode()
    def score(chunk: list[int], start: int) -> list[PromptLogprob]:
        hidden = model(torch.tensor([chunk], device=model.device), cache=cache)  # [1, C, h]
        logp = torch.log_softmax(model.logits(hidden[0]).float(), dim=-1)  # [C, V]
        # Row i predicts token start + i + 1 (the chunk's last row, the next chunk's first).
        nxt = ids[start + 1 : start + 1 + len(chunk)]
        rows = []
        for i, tok in enumerate(nxt):
            top = None
            if top_k > 0:
                values, idx = logp[i].topk(top_k)
                top = list(zip(idx.tolist(), values.tolist(), strict=True))
            rows.append(PromptLogprob(tok, float(logp[i, tok]), top))
        return rows

    for n, chunk in enumerate(_chunks(ids)):
        out += on_engine(functools.partial(score, chunk, n * CHUNK_TOKENS))
    return out
