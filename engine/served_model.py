"""A model loaded for serving: weights, tokenizer, its engine and the thread that runs it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.ar_engine import AREngine
from engine.worker import EngineWorker
from models import kernels
from models.config import ModelConfig
from models.loading import load_model
from models.sources import resolve
from models.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    name: str
    path: Path
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    max_model_len: int
    engine: AREngine
    worker: EngineWorker
    created: int

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    if folder.is_file() and folder.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(folder.parent), gguf_file=folder.name)
    return AutoTokenizer.from_pretrained(str(folder))


def load_served_model(
    name: str,
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    max_queue: int = 256,
) -> ServedModel:
    started = time.perf_counter()
    if device.type == "cpu" and dtype == torch.bfloat16:
        kernels.enable_cpu_kernels()  # compiled once per machine (~30 s), then cached
    path = resolve(spec)
    model, ckpt = load_model(path, device=device, dtype=dtype, resolve=resolve)
    if ckpt.config.is_diffusion:
        raise NotImplementedError(f"{name}: diffusion models are served by the CDLM engine")
    tokenizer = load_tokenizer(ckpt.tokenizer_folder or path)
    limit = min(
        max_model_len or ckpt.config.max_position_embeddings, ckpt.config.max_position_embeddings
    )
    engine = AREngine(model, tokenizer, limit)
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
        worker=EngineWorker(name, max_queue),
        created=int(time.time()),
    )
