"""Scaling with concurrent streams: our server's tokens/s at 1, 2, 4, 8, 16 and 32 clients.

    python -m cdlm_serve.bench.scaling [--concurrency 1 2 4 8 16 32] [--repeats 2]
                                       [--max-tokens 64] [--checkout DIR ...] [--quantize int8]
                                       [--isa avx2] [--json out.json]

For each concurrency c, a fresh server (`--max-batch c`, bf16, the CPU) takes bench.load's
clients: c streams of greedy completions, each generating exactly `--max-tokens` (ignore_eos),
4c requests (32 at least). Reported per point: generated tokens/s over the wall time, TTFT
p50/p99, errors, RSS; the median over `--repeats` rounds; and the ratio of each point to the
one before it (the goal of issue 38: 16 streams >= 1.3x the tokens/s of 8).

With several `--checkout` folders (e.g. a worktree of the commit before a change and this one)
each point runs every checkout's server in turn, in the same round, so machine noise hits them
alike; each checkout builds its CPU kernels in a folder of its own (TORCH_EXTENSIONS_DIR), as
the extension's name is the same in both.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

from cdlm_serve.bench.load import commit_of, free_port, rss_mb, run_load, start, stop, summary
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve


def _env(commit: str, primary: bool) -> dict[str, str]:
    """The server's environment: another checkout's kernels build in a folder of their own."""
    env = dict(os.environ)
    if not primary:
        env["TORCH_EXTENSIONS_DIR"] = str(
            Path.home() / ".cache" / "torch_extensions" / f"cdlm-{commit}"
        )
    return env


def one_point(
    args: argparse.Namespace, checkout: Path, commit: str, primary: bool, c: int, count
) -> dict:
    """One server of `checkout` (at `commit`) at max batch c under c clients; bench.load's
    summary + RSS."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A checkout from before the one package (9bc661c and older) has its server at the top.
    server = "cdlm_serve.server.cli" if (checkout / "cdlm_serve").is_dir() else "server.cli"
    cmd = [sys.executable, "-m", server, "serve", "--model", f"m={resolve(args.model)}"]
    cmd += ["--port", str(port), "--dtype", "bfloat16", "--device", "cpu"]
    cmd += ["--max-batch", str(c), "--log-level", "warning"]
    cmd += ["--cpu-isa", args.isa] if args.isa != "native" else []
    cmd += ["--quantize", args.quantize] if args.quantize else []
    log = args.logs / f"bench_scaling_{commit}_{c}.log"
    proc = start(cmd, url, log, cwd=checkout, env=_env(commit, primary))
    try:
        asyncio.run(run_load(url, "m", c, c, 0, 8, count))  # warm: every row once
        r = asyncio.run(
            run_load(url, "m", c, max(32, 4 * c), 0, args.max_tokens, count, {"ignore_eos": True})
        )
        rss = round(rss_mb(proc.pid), 1)
    finally:
        stop(proc)
    return {**summary(r), "rss_mb": rss}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quantize", choices=["int8"])
    p.add_argument(
        "--isa",
        choices=["native", "avx2", "avx512"],
        default="native",
        help="the servers' CPU instruction set (--cpu-isa): avx2 measures that path anywhere",
    )
    p.add_argument("--checkout", type=Path, action="append", help="whose server (repeatable)")
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = p.parse_args(argv)
    checkouts = [c.resolve() for c in (args.checkout or [Path.cwd()])]
    commits = {c: commit_of(c) for c in checkouts}

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve(args.model))

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    runs: dict[str, dict[int, list[dict]]] = {str(c): {} for c in checkouts}
    for _ in range(args.repeats):
        for c in args.concurrency:
            for i, checkout in enumerate(checkouts):
                point = one_point(args, checkout, commits[checkout], i == 0, c, count)
                runs[str(checkout)].setdefault(c, []).append(point)
                print(f"{commits[checkout]} c={c}: {point['tok_s']} tok/s", flush=True)

    out: dict = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "quantize": args.quantize,
        "repeats": args.repeats,
        "checkouts": {},
    }
    for checkout in checkouts:
        points = []
        for c in args.concurrency:
            rounds = runs[str(checkout)][c]
            points.append(
                {
                    "concurrency": c,
                    "tok_s": round(statistics.median(r["tok_s"] for r in rounds), 1),
                    "ttft_p50": round(statistics.median(r["ttft_p50"] for r in rounds), 3),
                    "ttft_p99": round(statistics.median(r["ttft_p99"] for r in rounds), 3),
                    "errors": sum(r["errors"] for r in rounds),
                    "rss_mb": max(r["rss_mb"] for r in rounds),
                    "rounds": rounds,
                }
            )
        for prev, point in itertools.pairwise(points):
            point["vs_previous"] = round(point["tok_s"] / prev["tok_s"], 2)
        out["checkouts"][f"{commits[checkout]} ({checkout})"] = points
    _print(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def _print(out: dict) -> None:
    kind = out["quantize"] or "bf16"
    print(
        f"\nscaling: {out['model']} ({kind}), {out['max_tokens']} tokens a request, "
        f"median of {out['repeats']}"
    )
    for name, points in out["checkouts"].items():
        print(f"\n{name}")
        print(f"{'clients':>8}{'tok/s':>9}{'x prev':>8}{'TTFT p50/p99 (s)':>20}{'errors':>8}"
              f"{'RSS MB':>8}")  # fmt: skip
        for pt in points:
            ratio = f"{pt['vs_previous']:.2f}" if "vs_previous" in pt else "-"
            print(
                f"{pt['concurrency']:>8}{pt['tok_s']:>9.1f}{ratio:>8}"
                f"{pt['ttft_p50']:>10.2f}/{pt['ttft_p99']:<9.2f}{pt['errors']:>8}"
                f"{pt['rss_mb']:>8.0f}"
            )


if __name__ == "__main__":
    main()
