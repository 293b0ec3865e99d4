"""Merge a PEFT LoRA adapter folder into base weights at load time.

An adapter folder holds `adapter_config.json` (r, lora_alpha, target_modules,
base_model_name_or_path) and `adapter_model.safetensors` with keys
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. Merging gives
W + scale * B @ A with scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), so serving a
merged model costs nothing extra per token.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

_KEY_RE = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight")


class AdapterError(ValueError):
    pass


@dataclass(slots=True)
class AdapterConfig:
    r: int
    alpha: float
    base: str | None
    use_rslora: bool

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def is_adapter_folder(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def read_adapter_config(folder: Path) -> AdapterConfig:
    raw = json.loads((folder / "adapter_config.json").read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"unsupported adapter type {raw.get('peft_type')!r} (LORA only)")
    if raw.get("use_dora"):
        raise AdapterError("DoRA adapters are not supported")
    r = int(raw["r"])
    return AdapterConfig(
        r=r,
        alpha=float(raw.get("lora_alpha", r)),
        base=raw.get("base_model_name_or_path"),
        use_rslora=bool(raw.get("use_rslora", False)),
    )


def read_adapter_weights(folder: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """module name -> (A [r, in], B [out, r])."""
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterError(f"{folder} has no adapter_model.safetensors")
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in load_file(str(path)).items():
        m = _KEY_RE.fullmatch(key)
        if m is None:
            raise AdapterError(f"unsupported adapter tensor {key!r} (only lora_A/lora_B)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter for {module} lacks lora_A or lora_B")
        out[module] = (ab["A"], ab["B"])
    return out


def merge_adapter(sd: dict[str, Tensor], folder: Path) -> dict[str, Tensor]:
    """Base state dict (checkpoint names) + adapter folder -> merged state dict."""
    cfg = read_adapter_config(folder)
    merged = dict(sd)
    for module, (a, b) in read_adapter_weights(folder).items():
        name = f"{module}.weight"
        if name not in merged:
            raise AdapterError(f"adapter targets {module}, which the base model lacks")
        w = merged[name]
        delta = (b.float() @ a.float()) * cfg.scale  # [out, in]
        if delta.shape != w.shape:
            raise AdapterError(
                f"adapter for {module} is {tuple(delta.shape)}, weight {tuple(w.shape)}"
            )
        merged[name] = (w.float() + delta).to(w.dtype)
    return merged


def resolve_base(folder: Path, base: str | None) -> str:
    """Where the adapter's base model is: an explicit override, else the adapter's own field
    (a path relative to the adapter folder is accepted)."""
    name = base or read_adapter_config(folder).base
    if not name:
        raise AdapterError(f"{folder}: adapter names no base model; pass one explicitly")
    relative = (folder / name).resolve()
    return str(relative) if relative.is_dir() else name


def save_adapter(
    folder: Path,
    weights: dict[str, tuple[Tensor, Tensor]],
    r: int,
    alpha: float,
    base: str,
    target_modules: list[str],
) -> None:
    """Write a PEFT-format adapter folder (used by training; mirrors what PEFT writes)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": target_modules,
        "base_model_name_or_path": base,
        "use_rslora": False,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))


__all__ = [
    "AdapterError",
    "is_adapter_folder",
    "merge_adapter",
    "read_adapter_config",
    "resolve_base",
    "save_adapter",
]
