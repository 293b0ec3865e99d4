"""Model work outside the engine's steps: where a piece of it runs (`OnEngine`: the server
passes its engine thread's `run`, which queues the piece as work with a priority between two
decode steps; `inline` runs it right here), and a plain prefill for tools and tests.

The server itself prefills a session's prompt and scores an echoed prompt through the AR
engine (a sequence of `max_tokens` 0, `SamplingParams.prompt_logprobs`): the same chunked
prefill and step budget as every prompt. What still comes here as pieces is a compaction's
model work (`engine.compaction`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.transformer import Transformer

T = TypeVar("T")
# Runs one piece of model work where the model may be used, and returns its result.
OnEngine = Callable[[Callable[[], T]], T]

# Prompt tokens one forward of `prefill` takes: its logits-free forward stays small in memory
# however long the prompt.
CHUNK_TOKENS = 512


def inline(fn: Callable[[], T]) -> T:
    """Run model work right here (benchmarks, tests, a model nobody else is using)."""
    return fn()


@torch.no_grad()  # not inference mode: the cache may be written later (a compaction)
def prefill(model: Transformer, ids: list[int]) -> KVCache:
    """A fresh batch-1 cache holding `ids`, prefilled here in chunks (tools, benches, tests: a
    model no engine is using)."""
    cache = model.new_cache(1, len(ids))
    for start in range(0, len(ids), CHUNK_TOKENS):
        chunk = ids[start : start + CHUNK_TOKENS]
        model(torch.tensor([chunk], device=model.device), cache=cache)
    if cache.window is not None:
        cache.window.trim(cache.logical)  # the chunks grew the ring: back to the window
    return cache
