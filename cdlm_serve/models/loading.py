"""Build a `Transformer` from a checkpoint on disk.

Accepted: an HF folder (config.json + model.safetensors, or shards listed in
model.safetensors.index.json), a GGUF file (dequantized), or a PEFT LoRA adapter folder whose
base is any of those (merged at load).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from cdlm_serve.models import gguf, lora
from cdlm_serve.models.config import ModelConfig
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.models.weights import to_native


class CheckpointError(ValueError):
    pass


@dataclass(slots=True)
class Checkpoint:
    """Weights under their checkpoint names, plus the config that explains them."""

    config: ModelConfig
    raw_config: dict[str, Any]
    weights: dict[str, Tensor]
    # Folder holding the tokenizer (the base's folder for an adapter); None for a bare GGUF.
    tokenizer_folder: Path | None
    # A GGUF's Q8_0 matrices as stored (codes, scales), under canonical names; `weights` has
    # them dequantized. Int8 serving takes these (models/quantize.py).
    q8: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # A GGUF's quantized tensors by type ({"Q4_K": 120, ...}): what was dequantized at load.
    quantized: dict[str, int] = field(default_factory=dict)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{folder} holds no .safetensors weights")
    return found


def read_safetensors(folder: Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                t = f.get_tensor(key)
                out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def read_checkpoint(
    source: str | Path,
    dtype: torch.dtype | None = None,
    resolve: Callable[[str], Path] | None = None,
) -> Checkpoint:
    """Read weights and config. `resolve` turns an adapter's base name into a folder."""
    path = Path(source)
    raw: dict[str, Any] | None  # the HF-style config (None: a folder without config.json)
    if path.is_file() and path.suffix == ".gguf":
        reader = gguf.open_gguf(path)
        raw = gguf.read_config(reader)
        weights = {
            name: (t.to(dtype) if dtype is not None else t)
            for name, t in gguf.iter_weights(reader, raw)
        }
        q8 = {name: (c, s) for name, c, s in gguf.iter_q8_0(reader, raw)}
        cfg = ModelConfig.from_hf_dict(raw)
        return Checkpoint(cfg, raw, weights, None, q8, gguf.quantized_types(reader))
    if not path.is_dir():
        raise CheckpointError(f"{source} is neither a model folder nor a .gguf file")
    if lora.is_adapter_folder(path):
        base_name = lora.resolve_base(path, None)
        base_path = Path(base_name) if Path(base_name).exists() else None
        if base_path is None:
            if resolve is None:
                raise CheckpointError(f"cannot find the adapter's base model {base_name!r}")
            base_path = resolve(base_name)
        base = read_checkpoint(base_path, dtype, resolve)
        merged = lora.merge_adapter(base.weights, path)
        return Checkpoint(base.config, base.raw_config, merged, base.tokenizer_folder)
    raw = (
        json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    )
    if raw is None:
        raise CheckpointError(f"{path} has no config.json")
    return Checkpoint(ModelConfig.from_hf_dict(raw), raw, read_safetensors(path, dtype), path)


def build_model(
    ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    native = {k: v.to(dtype) for k, v in to_native(ckpt.weights, ckpt.config).items()}
    with torch.device("meta"):
        model = Transformer(ckpt.config, dtype=dtype)
    # assign=True adopts our tensors instead of copying into meta storage.
    model.load_state_dict(native, strict=True, assign=True)
    # Loaded for inference: training code turns gradients back on for what it trains.
    return model.to(device).eval().requires_grad_(False)


def load_model(
    source: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    resolve: Callable[[str], Path] | None = None,
) -> tuple[Transformer, Checkpoint]:
    ckpt = read_checkpoint(source, None, resolve)
    model = build_model(ckpt, device, dtype)
    ckpt.weights = {}  # the model owns the tensors now
    return model, ckpt
