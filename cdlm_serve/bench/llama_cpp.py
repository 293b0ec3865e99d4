"""llama.cpp's `llama-server` as a benchmark peer, built here from source: the llama.cpp that the
`llama-cpp-python` sdist vendors (PyPI is reachable where model hubs are not), compiled once
per instruction set into the user's cache (`native`: GGML_NATIVE, for this CPU; `avx2` or
`avx512`: that ISA's ggml kernels only, so that the AVX2 comparison can be made on an AVX512
machine too), and our model converted to GGUF with the converter that ships with it (bf16,
then `llama-quantize` to Q8_0).

    python -m cdlm_serve.bench.llama_cpp [--isa avx2]   # build (minutes, once), convert, print

Everything lands under $CDLM_SERVE_HOME/llama.cpp/<version>/ (binaries in bin-<isa>/), each
step into a temporary folder renamed into place when complete, so an interrupted build is
simply redone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from cdlm_serve.models.fetch import assemble_gguf, serve_home
from cdlm_serve.models.sources import BUILTIN, DEFAULT_AR_MODEL, resolve

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp
TARGETS = ("llama-server", "llama-quantize")


def home() -> Path:
    return serve_home() / "llama.cpp" / VERSION


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def source() -> Path:
    """The vendored llama.cpp tree of the sdist (downloaded and unpacked once)."""
    out = home() / "src"
    if (out / "CMakeLists.txt").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", tmp]
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        vendored = Path(tmp) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        if out.exists():
            shutil.rmtree(out)
        vendored.rename(out)
    return out


# ggml's CPU flags per instruction set: what `-DGGML_NATIVE=OFF` builds. avx2 is x86-64-v3
# (AVX2, FMA, F16C; AVX-VNNI off: our AVX2 build does not use it either), avx512 adds
# AVX512-BF16 and -VNNI, as our AVX512 build needs.
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF"),
    "avx512": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"),
}  # fmt: skip


def binaries(isa: str = "native") -> dict[str, Path]:
    """llama-server and llama-quantize, built for `isa` (once: ~10 min on 2 cores)."""
    bin_dir = home() / ("bin" if isa == "native" else f"bin-{isa}")
    found = {t: bin_dir / t for t in TARGETS}
    if all(p.is_file() for p in found.values()):
        return found
    src = source()
    build = Path(tempfile.mkdtemp(prefix="build-", dir=home()))
    try:
        _run(
            ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             *ISA_FLAGS[isa], "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DBUILD_SHARED_LIBS=OFF"]
        )  # fmt: skip
        jobs = str(os.cpu_count() or 2)
        _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", jobs])
        staged = Path(tempfile.mkdtemp(prefix="bin-", dir=home()))
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, staged / target)
        if bin_dir.exists():
            shutil.rmtree(bin_dir)
        staged.rename(bin_dir)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return found


def quantize_tool() -> Path:
    """llama-quantize of any build already made (its output is the same whatever the ISA),
    else of the native one."""
    for isa in ISA_FLAGS:
        bin_dir = home() / ("bin" if isa == "native" else f"bin-{isa}")
        if (bin_dir / "llama-quantize").is_file():
            return bin_dir / "llama-quantize"
    return binaries()["llama-quantize"]


def gguf(model: str = DEFAULT_AR_MODEL, kind: str = "bf16") -> Path:
    """`model` (an HF folder we serve) as a GGUF file, made once:
    - "source": a built-in model's own GGUF, the file ours is converted from (SmolLM2's Q4_1,
      Gemma 3 270M's Q4_K_M), assembled from its pinned wheels;
    - "bf16": a built-in model's source widened by llama-quantize, the same numbers ours are
      (llama.cpp's converter cannot read our Gemma folder: it wants the sentencepiece file,
      which the GGUF does not carry); llama.cpp's converter on any other folder;
    - "Q8_0" (or another llama-quantize type): llama-quantize from the bf16 file."""
    out = home() / "models" / f"{Path(model).name}-{kind}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if kind == "source":
        if model not in BUILTIN:
            raise ValueError(f"{model!r} is not a built-in model: it has no source GGUF")
        with tempfile.TemporaryDirectory(dir=out.parent) as work:
            assemble_gguf(BUILTIN[model], Path(work)).rename(out)
        return out
    if kind == "bf16" and model in BUILTIN:
        quantize = str(quantize_tool())
        _run([quantize, "--allow-requantize", str(gguf(model, "source")), str(tmp), "BF16"])
    elif kind == "bf16":
        src = source()
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(resolve(model))]
        print("+", " ".join(cmd), flush=True)
        subprocess.run([*cmd, "--outtype", "bf16", "--outfile", str(tmp)], check=True, env=env)
    else:
        _run([str(quantize_tool()), str(gguf(model, "bf16")), str(tmp), kind])
    tmp.rename(out)
    return out


def server_command(
    model_file: Path, port: int, slots: int, context: int = 2048, isa: str = "native"
) -> list[str]:
    """llama-server (built for `isa`) on 127.0.0.1:port (0: a "{port}" placeholder) with
    `slots` parallel sequences (continuous batching), `context` tokens each, on every core."""
    return [
        str(binaries(isa)["llama-server"]),
        "-m", str(model_file),
        "--host", "127.0.0.1",
        "--port", str(port) if port else "{port}",
        "-np", str(slots),
        "-c", str(context * slots),
        "-t", str(os.cpu_count() or 2),
        "--cont-batching",
        "--no-webui",
    ]  # fmt: skip


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native")
    args = parser.parse_args()
    print(binaries(args.isa))
    print(gguf(kind="bf16"), gguf(kind="Q8_0"))
