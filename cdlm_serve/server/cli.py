"""`cdlm-serve`: serve models over HTTP, or fetch the default model ahead of time."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cdlm_serve.models import kernels
from cdlm_serve.models.sources import (
    DEFAULT_AR_MODEL,
    DEFAULT_DLM_MODEL,
    SHIPPED,
    default_name,
    resolve,
)

if TYPE_CHECKING:  # parse_model_spec imports it where it runs
    from cdlm_serve.server.state import ModelSpec

# SmolLM2 (autoregressive) and our CDLM student (diffusion, models/shipped/), side by side.
DEFAULT_MODELS = f"{DEFAULT_AR_MODEL},{DEFAULT_DLM_MODEL}"  # routed by the request's `model`
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"CDLM_SERVE_{name}", default)


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        # bf16 on GPUs, and on CPUs where our fused decode kernels run (AVX512-BF16, or AVX2:
        # bf16 weights, fp32 arithmetic in registers), where it streams half fp32's bytes;
        # elsewhere on CPU fp32, since PyTorch's own bf16 matrix-vector products are no faster
        # than fp32 ones.
        if device.type == "cuda" or kernels.cpu_isa() is not None:
            return torch.bfloat16
        return torch.float32
    return DTYPES[choice]


def dtype_reason(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """Why the models run in `dtype`, for the start-up log."""
    name = str(dtype).removeprefix("torch.")
    if choice != "auto":
        return f"{name} (--dtype {choice})"
    if device.type != "cpu":
        return f"{name} (auto: a GPU)"
    return f"{name} (auto: {kernels.isa_choice()})"


def parse_model_spec(text: str) -> ModelSpec:
    """NAME=SOURCE, or just SOURCE (served under the source's own name)."""
    from cdlm_serve.server.state import ModelSpec

    name, sep, source = text.partition("=")
    if sep and name and "/" not in name:
        return ModelSpec(name, source)
    return ModelSpec(default_name(text, Path(text).expanduser()), text)


@dataclass(frozen=True, slots=True)
class Flag:
    """One `serve` flag: its environment variable is CDLM_SERVE_ and its name in capitals, and
    a default is given as the text the environment would hold (argparse converts both)."""

    name: str
    group: str
    help: str
    default: str | None = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switch: bool = False  # on/off: the flag alone turns it on; its variable holds 1/0

    @property
    def env(self) -> str:
        return "CDLM_SERVE_" + self.name.removeprefix("--").upper().replace("-", "_")

    def add_to(self, group: Any) -> None:
        # A string default goes through `type` like a command-line value: a bad environment
        # value is a usage error naming the flag, not a traceback.
        default = os.environ.get(self.env, self.default)
        help = f"{self.help} (env {self.env}" + (
            f"; default {self.default})" if self.default is not None else ")"
        )
        if self.switch:
            group.add_argument(
                self.name,
                type=_switch,
                nargs="?",
                const="1",
                default=default or "0",
                metavar="0|1",
                help=help,
            )
        else:
            group.add_argument(
                self.name,
                type=self.type,
                default=default,
                choices=self.choices,
                metavar=self.metavar,
                help=help,
            )


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("1", "0", "true", "false", "yes", "no", "on", "off", ""):
        raise argparse.ArgumentTypeError(f"{text!r} is not 1 or 0")
    return value in ("1", "true", "yes", "on")


GROUPS = {
    "server": "HTTP",
    "models": "models",
    "limits": "limits (per model)",
    "sessions": "sessions",
    "compaction": "compaction",
}
FLAGS = (
    Flag("--host", "server", "address to bind", "127.0.0.1"),
    Flag("--port", "server", "port to bind", "8000", int),
    Flag(
        "--api-key",
        "server",
        "require 'Authorization: Bearer KEY' on every /v1 route; /health, /version and /metrics "
        "stay open",
    ),
    Flag("--max-body-mb", "server", "largest request body; larger ones answer 413", "8", float),
    Flag(
        "--log-level", "server", "log level", "info", choices=("debug", "info", "warning", "error")
    ),
    Flag("--device", "models", "cpu, cuda, cuda:N or auto (cuda when there is one)", "auto"),
    Flag(
        "--dtype",
        "models",
        "weight/activation dtype; auto = bfloat16 on GPUs and on CPUs with the fused kernels "
        "(AVX512-BF16 or AVX2), else float32",
        "auto",
        choices=("auto", *DTYPES),
    ),
    Flag(
        "--cpu-isa",
        "models",
        "the fused CPU kernels' instruction set: native (the best this CPU has), avx512 or avx2 "
        "(to run or measure the AVX2 path on an AVX512 machine)",
        "native",
        choices=("native", "avx512", "avx2"),
    ),
    Flag(
        "--quantize",
        "models",
        "int8: Q8_0 weights (32 per scale, llama.cpp's format) for every model's matrices and "
        "output head; decode steps multiply them as int8 on CPUs with AVX512-VNNI (bf16 only)",
        choices=("int8",),
    ),
    Flag(
        "--batch-invariant",
        "models",
        "reproducible answers: every step runs through the fused CPU step, so a greedy or "
        "seeded answer is the same bits alone, in any batch, chunked or not, after a prefix-"
        "cache hit or from a restored session (bf16 on CPU; the log says whether it holds). "
        "On by default: on the AVX2 CPU measured it costs nothing at the CPU's defaults and is "
        "faster where it changes the path (docs/models.md)",
        "1",
        switch=True,
    ),
    Flag(
        "--max-model-len",
        "models",
        "cap on prompt + completion tokens (default: the model's own context length)",
        type=int,
    ),
    Flag("--max-queue", "limits", "requests allowed to wait per model before 429", "256", int),
    Flag("--max-batch", "limits", "sequences a model decodes together", "8", int),
    Flag(
        "--prefill-tokens-per-step",
        "limits",
        "prompt tokens one engine step prefills (chunked prefill: longer prompts join over "
        "several steps while running requests keep decoding; default 512 on GPUs, 128 on CPUs)",
        type=int,
    ),
    Flag(
        "--no-prefix-caching",
        "limits",
        "turn automatic prefix caching off: every prompt is prefilled in full (by default "
        "the KV of prompt prefixes is kept and reused by later requests that start alike)",
        switch=True,
    ),
    Flag(
        "--prefix-cache-mb",
        "limits",
        "prompt KV the prefix cache keeps per model (least recently used blocks go first)",
        "512",
        int,
    ),
    Flag(
        "--heap-trim-seconds",
        "limits",
        "on CPU with glibc, give freed heap memory back to the OS (malloc_trim) this often, "
        "and a second after a big free; 0 = never (docs/deploy.md: memory)",
        "60",
        float,
    ),
    Flag(
        "--malloc-arenas",
        "limits",
        "on glibc, at most this many malloc arenas (glibc's own default, 8 per core, keeps "
        "each thread's peak: RSS creeps); 0 = glibc's default (docs/deploy.md: memory)",
        "2",
        int,
    ),
    Flag(
        "--sessions-dir",
        "sessions",
        "where sessions are stored (default $CDLM_SERVE_HOME/sessions)",
        type=Path,
    ),
    Flag(
        "--session-memory-mb",
        "sessions",
        "session caches kept in memory before the least recently used go to disk",
        "2048",
        int,
    ),
    Flag(
        "--session-lock-wait",
        "sessions",
        "seconds a request waits for a busy session before 409",
        "10",
        float,
    ),
    Flag(
        "--max-sessions",
        "sessions",
        "sessions the store may hold; creating one more answers 507",
        "1024",
        int,
    ),
    Flag(
        "--responses-ttl-hours",
        "sessions",
        "hours a stored response (/v1/responses with store) is kept before it is removed, as "
        "OpenAI keeps them 30 days; 0 = until deleted",
        "720",
        float,
    ),
    Flag(
        "--sessions-disk-gb",
        "sessions",
        "disk quota of the session store in GB; requests that would grow it past the quota "
        "answer 507, 0 = no quota",
        "20",
        float,
    ),
    Flag(
        "--sessions-redis",
        "sessions",
        "share sessions between replicas through Redis: every change is written through, a "
        "replica without a session loads it from there, and a lease keeps two replicas from "
        "changing one session at once",
        metavar="redis://HOST:PORT/DB",
    ),
    Flag(
        "--compaction-omp-budget",
        "compaction",
        "seconds of exact OMP key selection per compaction; past it OMP continues as "
        "am-omp-fast, past twice it takes the remaining keys by attention, and the response "
        "says so",
        "60",
        float,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdlm-serve",
        description="OpenAI-compatible server for CDLM diffusion decoding and "
        "Attention Matching KV compaction.",
    )
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser(
        "serve",
        help="serve models over HTTP (the default command)",
        description="Serve models over HTTP (OpenAI's API on /v1). Every flag can also be set "
        "by the environment variable it names. `cdlm-serve fetch [MODEL ...]` downloads and "
        "converts built-in models ahead of time.",
    )
    groups = {key: serve.add_argument_group(title) for key, title in GROUPS.items()}
    groups["models"].add_argument(
        "--model",
        action="append",
        metavar="[NAME=]SOURCE",
        help="a model to serve; repeat for several. SOURCE is a built-in name "
        f"({DEFAULT_AR_MODEL}, {', '.join(SHIPPED)}), a local HF folder, a .gguf file, a LoRA "
        "adapter folder or a hub id; NAME is what clients put in `model` (env CDLM_SERVE_MODEL, "
        f"comma-separated; default {DEFAULT_MODELS})",
    )
    for flag in FLAGS:
        flag.add_to(groups[flag.group])

    fetch = sub.add_parser("fetch", help="download and convert the built-in model(s) now")
    fetch.add_argument(
        "models",
        nargs="*",
        default=[DEFAULT_AR_MODEL],
        help=f"built-in model names (default: {DEFAULT_AR_MODEL})",
    )
    return parser


def refuse_bad_flags(args: argparse.Namespace) -> None:
    """Exit with a line naming the flag for a value no server can run with: before anything
    heavy is imported or loaded, so a typo costs a second, not a model load."""
    if args.api_key is not None and not args.api_key.strip():
        sys.exit(
            "cdlm-serve: the API key (--api-key or CDLM_SERVE_API_KEY) is empty; give a real "
            "key, or leave it out to serve without auth"
        )
    for flag, value in (
        ("--max-sessions", args.max_sessions),
        ("--max-body-mb", args.max_body_mb),
        ("--prefill-tokens-per-step", args.prefill_tokens_per_step or 1),
        ("--compaction-omp-budget", args.compaction_omp_budget),
    ):
        if value <= 0:
            sys.exit(f"cdlm-serve: {flag} must be > 0")
    if not 0 <= args.responses_ttl_hours < float("inf"):
        sys.exit("cdlm-serve: --responses-ttl-hours must be >= 0 (0 = until deleted)")
    if args.malloc_arenas < 0:
        sys.exit("cdlm-serve: --malloc-arenas must be >= 0 (0 = glibc's default)")
    if args.heap_trim_seconds < 0:
        sys.exit("cdlm-serve: --heap-trim-seconds must be >= 0 (0 = never)")
    if args.prefix_cache_mb < 0:
        sys.exit("cdlm-serve: --prefix-cache-mb must be >= 0 (0 keeps nothing)")
    if args.sessions_disk_gb < 0:
        sys.exit("cdlm-serve: --sessions-disk-gb must be >= 0 (0 = no quota)")


def serve(args: argparse.Namespace) -> None:
    """Serve `args`. Bad flags are refused here too, for callers other than `main` (which
    refuses them before the heavy imports)."""
    import uvicorn

    from cdlm_serve.engine.heap import limit_arenas
    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ServerSettings

    refuse_bad_flags(args)
    limit_arenas(args.malloc_arenas)  # now: before uvicorn, the engines and OpenMP start threads
    specs = args.model or (_env("MODEL") or DEFAULT_MODELS).split(",")
    device = pick_device(args.device)
    os.environ[kernels.ISA_ENV] = args.cpu_isa  # what models.kernels builds and uses
    if device.type == "cpu" and args.cpu_isa not in ("native", kernels.cpu_isa()):
        sys.exit(f"cdlm-serve: --cpu-isa {args.cpu_isa}: this CPU cannot run it")
    dtype = pick_dtype(args.dtype, device)
    logging.getLogger("cdlm-serve").info(
        "models run in %s", dtype_reason(args.dtype, dtype, device)
    )
    settings = ServerSettings(
        models=[parse_model_spec(s.strip()) for s in specs if s.strip()],
        device=device,
        dtype=dtype,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        prefill_tokens=args.prefill_tokens_per_step,
        prefix_cache_bytes=0 if args.no_prefix_caching else args.prefix_cache_mb << 20,
        heap_trim_seconds=args.heap_trim_seconds,
        quantize=args.quantize,
        batch_invariant=args.batch_invariant,
        api_key=args.api_key,
        sessions_dir=args.sessions_dir,
        session_memory_bytes=args.session_memory_mb << 20,
        session_lock_wait=args.session_lock_wait,
        max_sessions=args.max_sessions,
        responses_ttl=args.responses_ttl_hours * 3600.0,
        sessions_disk_bytes=int(args.sessions_disk_gb * 1e9) if args.sessions_disk_gb else None,
        sessions_redis=args.sessions_redis,
        compaction_omp_budget=args.compaction_omp_budget,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
    )
    names = [m.name for m in settings.models]
    if len(set(names)) != len(names):
        sys.exit(f"cdlm-serve: two models would be served as the same name: {names}")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("cdlm-serve").warning(
            "serving on %s without --api-key: anyone who can reach port %d can run, read and "
            "delete sessions; set CDLM_SERVE_API_KEY",
            args.host,
            args.port,
        )
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def configure_logging(level: str) -> None:
    """One line per record, with the request id of the HTTP request it belongs to."""
    from cdlm_serve.server.request_context import RequestIdFilter

    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
    )
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        # `cdlm-serve` alone serves the default models, and `cdlm-serve --help` lists the
        # flags that does (in groups, each with its environment variable).
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    if args.command == "serve":
        refuse_bad_flags(args)
    configure_logging(getattr(args, "log_level", "info"))
    if args.command == "fetch":
        for name in args.models:
            print(resolve(name))
    else:
        serve(args)


if __name__ == "__main__":
    main()
