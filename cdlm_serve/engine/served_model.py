"""A model loaded for serving: weights, tokenizer, its engine and the thread that runs it."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from cdlm_serve.engine.compaction import load_schedule
from cdlm_serve.engine.core_share import CoreShare
from cdlm_serve.engine.decoding import (
    FUSED_PREFILL_TOKENS,
    AREngine,
    ARSequence,
    DLMEngine,
    DLMSequence,
    Engine,
    PrefixCache,
    eos_token_ids,
)
from cdlm_serve.engine.engine_thread import EngineThread
from cdlm_serve.models import kernels
from cdlm_serve.models.config import ModelConfig
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.quantize import quantize_model, serving_quantization
from cdlm_serve.models.sources import resolve
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.models.weights import native_q8

log = logging.getLogger(__name__)


class Telemetry(Protocol):
    """What a served model reports as its engine works (server.metrics.Metrics is one): the
    engine defines it, so the engine never depends on the server."""

    def observe_ar_sequence(self, model: str, seq: ARSequence) -> None:
        """An AR sequence left the engine (finished or aborted)."""

    def observe_dlm_sequence(
        self, model: str, decoding: str, seq: DLMSequence, seconds: float
    ) -> None:
        """A diffusion sequence left the engine, `seconds` after it arrived."""

    def observe_dlm_step(self, model: str, seconds: float) -> None:
        """One step of a diffusion engine took `seconds`."""


@dataclass(slots=True)
class ServedModel:
    name: str
    path: Path
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    max_model_len: int
    # Either kind, used through the contract alone (`Engine`: its params, its limits).
    engine: Engine[Any, Any]
    thread: EngineThread  # the engine runs on it; model work goes through it too
    created: int
    max_token_chars: int = 1  # the longest token's text: a longer prompt cannot fit the context
    chat_template: str | None = None  # the tokenizer's, if it has one (else no chat route)
    # Compaction budgets measured for this model (engine/compaction/budget_schedules/), if any
    # shipped.
    budget_schedule: list[list[float]] | None = None
    # The token a text starting a sequence begins with, where the tokenizer adds one (Gemma's
    # <bos>: without it the model's outputs fall apart); None where it adds none (SmolLM2).
    bos_id: int | None = None

    def sequence_start(self, ids: list[int]) -> list[int]:
        """`ids` as the start of a sequence: the tokenizer's BOS first where it adds one (as
        vLLM tokenizes a completion's prompt), unless the text already began with it."""
        if self.bos_id is None or not ids or ids[:1] == [self.bos_id]:
            return ids
        return [self.bos_id, *ids]

    @property
    def is_diffusion(self) -> bool:
        return self.config.is_diffusion

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens an answer stops at (the config's and the tokenizer's)."""
        return eos_token_ids(self.config.eos_token_ids, self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; ValueError, before tokenizing, for a text so long that even
        the longest tokens could not fit it in the context."""
        if len(text) > self.max_model_len * self.max_token_chars:
            raise ValueError(
                f"a prompt of {len(text)} characters cannot fit the context of "
                f"{self.max_model_len} tokens"
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if folder.is_file() and folder.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(folder.parent), gguf_file=folder.name)
    config = folder / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if (model_type is not None and model_type not in CONFIG_MAPPING) or _names_its_class(folder):
        # Its tokenizer files say everything. Reading config.json would only warn about a type
        # transformers does not know (LLaDA, Dream: we load those natively), or, for one it
        # knows, import that model's configuration module, which pulls in torch.distributed
        # and torch's compiler: ~2.5 s of every server start, for a class the files name.
        return AutoTokenizer.from_pretrained(str(folder), config=PretrainedConfig())
    return AutoTokenizer.from_pretrained(str(folder))


def _names_its_class(folder: Path) -> bool:
    """Whether the folder's tokenizer_config.json names the tokenizer's class (then
    AutoTokenizer needs nothing from the model's config to choose it)."""
    path = folder / "tokenizer_config.json"
    return path.is_file() and bool(json.loads(path.read_text()).get("tokenizer_class"))


def _quantization(
    name: str,
    asked: str | None,
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]],
    quantized: dict[str, int],
    model: Any,
) -> str | None:
    """`serving_quantization`, saying in the log what it chose and what a GGUF had widened."""
    kind = serving_quantization(asked, stored, model)
    if kind != asked:
        log.info("%s: every matrix of the GGUF is Q8_0: served as int8 with its codes", name)
    widened = {t: n for t, n in quantized.items() if not (t == "Q8_0" and kind == "int8")}
    if widened:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(widened.items()))
        log.info("%s: GGUF tensors dequantized at load (no fused kernel for them): %s", name, kinds)
    return kind


def load_served_model(
    name: str,
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    max_queue: int = 256,
    max_batch: int = 8,
    metrics: Telemetry | None = None,
    prefill_tokens: int | None = None,
    cores: CoreShare | None = None,
    prefix_cache_bytes: int = 0,
    quantize: str | None = None,
    batch_invariant: bool = False,
) -> ServedModel:
    """Load a model and start its engine thread. `prefix_cache_bytes` > 0 turns automatic
    prefix caching on for an AR model, holding at most that many bytes of prompt KV;
    `quantize="int8"` gives it Q8_0 weights (models/quantize.py); `batch_invariant` asks for
    answers that do not depend on the batch (`ModelRunner`; the log says if it holds)."""
    started = time.perf_counter()
    if device.type == "cpu" and kernels.cpu_isa() is not None:
        log.info("%s: building the fused CPU kernels (~30 s the first time, then cached)", name)
        active = kernels.enable_cpu_kernels()
        log.info("%s: %s, %s", name, kernels.isa_choice(), "ready" if active else "failed to build")
    if quantize not in (None, "int8"):
        raise ValueError(f"unknown quantization {quantize!r} (known: int8)")
    share = cores or CoreShare.shared()
    with share.working():  # converting and loading weights on every core, through the share
        log.info("%s: finding %s (a built-in model is fetched and converted once)", name, spec)
        path = share.run(lambda: resolve(spec))
        log.info("%s: loading weights from %s on %s/%s", name, path, device, dtype)
        model, ckpt = share.run(
            lambda: load_model(path, device=device, dtype=dtype, resolve=resolve)
        )
        stored = native_q8(ckpt.q8, ckpt.config)
        ckpt.q8 = {}
        quantize = _quantization(name, quantize, stored, ckpt.quantized, model)
        count = share.run(lambda: quantize_model(model, stored)) if quantize == "int8" else 0
    if quantize == "int8":
        isa = kernels.active_isa() if device.type == "cpu" else None
        fused = isa is not None and dtype == torch.bfloat16
        fused = fused and kernels.fused_step_takes(ckpt.config)
        log.info(
            "%s: %d matrices int8 (Q8_0; %d with the file's own codes); %s",
            name,
            count,
            len(stored),
            f"decode steps multiply them as int8 ({'AVX512-VNNI' if isa == 'avx512' else 'AVX2'})"
            if fused
            else "dequantized for this device, dtype or family (no fused step): answers as "
            "int8, no speed gain here",
        )
    tokenizer = load_tokenizer(ckpt.tokenizer_folder or path)
    limit = min(
        max_model_len or ckpt.config.max_position_embeddings, ckpt.config.max_position_embeddings
    )
    engine: Engine[Any, Any]
    on_step = None
    if ckpt.config.is_diffusion:
        dlm = DLMEngine(
            model, tokenizer, limit, max_batch=max_batch, batch_invariant=batch_invariant
        )
        invariance = dlm.context.runner.invariance()
        if metrics is not None:
            telemetry = metrics  # bound for the lambdas (mypy narrows no closure)
            dlm.scheduler.on_finish = lambda seq: telemetry.observe_dlm_sequence(
                name, seq.params.decoding, seq, time.perf_counter() - seq.started
            )
            on_step = lambda seconds: telemetry.observe_dlm_step(name, seconds)  # noqa: E731
        engine = dlm
    else:
        # Chunked prefill: a chunk is one step's stall for the running requests. On a CPU a
        # chunk small enough for the fused step keeps that to a few hundred ms (SmolLM2).
        chunk = prefill_tokens or (512 if device.type == "cuda" else FUSED_PREFILL_TOKENS)
        prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        ar = AREngine(model, tokenizer, limit, max_batch, chunk, prefix, batch_invariant)
        invariance = ar.runner.invariance()
        if metrics is not None:
            telemetry = metrics
            ar.scheduler.on_finish = lambda seq: telemetry.observe_ar_sequence(name, seq)
        engine = ar
    log.info("%s: batch-invariant %s", name, invariance)
    thread = EngineThread(name, engine, max_queue, on_step=on_step, cores=share)
    log.info(
        "loaded %s from %s on %s/%s in %.1fs",
        name,
        path,
        device,
        dtype,
        time.perf_counter() - started,
    )
    return ServedModel(
        name=name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=ckpt.config,
        max_model_len=limit,
        engine=engine,
        thread=thread,
        created=int(time.time()),
        max_token_chars=max((len(t) for t in tokenizer.get_vocab()), default=1),
        chat_template=getattr(tokenizer, "chat_template", None),  # tokenizers without one
        budget_schedule=load_schedule(spec, ckpt.config),
        bos_id=None if ckpt.config.is_diffusion else _added_bos(tokenizer),
    )


def _added_bos(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts before a text of its own accord, if it does."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return int(bos) if ids[:1] == [bos] else None
