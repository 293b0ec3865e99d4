"""Autoregressive generation: prefill once, then one token per step against the KV cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling import SamplingParams, make_generator, sample
from engine.text_output import TextAssembler
from models.transformer import Transformer


@dataclass(slots=True)
class StepOutput:
    """What one decoding step adds to a request's answer."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished


class AREngine:
    def __init__(self, model: Transformer, tokenizer: Any, max_model_len: int):
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        eos = set(model.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        aborted: Callable[[], bool] = lambda: False,
    ) -> Iterator[StepOutput]:
        """Yield one StepOutput per generated token; the last one has a finish_reason."""
        model = self.model
        device = model.device
        budget = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        if budget < 1:
            raise ValueError("prompt leaves no room for new tokens")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        generator = None if params.greedy else make_generator(params.seed, device)
        text = TextAssembler(self.tokenizer, list(params.stop))

        cache = model.new_cache(1, len(prompt_ids) + budget)
        tokens = torch.tensor([prompt_ids], device=device)  # [1, P]
        for step in range(budget):
            if aborted():
                yield StepOutput([], "", "abort")
                return
            hidden = model(tokens, cache=cache)  # [1, Q, hidden]
            logits = model.logits(hidden[:, -1])  # [1, V]
            next_id = sample(logits, params, generator)  # [1]
            token = int(next_id.item())
            if token in stop_ids:
                # Counted as generated (as OpenAI and vLLM do), never shown as text.
                yield StepOutput([token], text.flush(), "stop")
                return
            delta = text.push(token)
            if delta.stopped:
                yield StepOutput([token], delta.text, "stop")
                return
            if step == budget - 1:
                yield StepOutput([token], delta.text + text.flush(), "length")
                return
            yield StepOutput([token], delta.text)
            tokens = next_id.view(1, 1)
