"""Load test: bounded concurrent clients against our server, then against `transformers serve`
on the same model and prompts, side by side.

    python -m cdlm_serve.bench.load [--concurrency 8] [--requests 48] [--max-tokens 64]
                                    [--json out.json]
    python -m cdlm_serve.bench.load --soak 300 --no-peer        # RSS growth over a 5-minute soak

Both servers are started here on 127.0.0.1 (ours with `cdlm-serve serve`, the peer with
`transformers serve --continuous-batching`, its strongest configuration), both bf16 on the CPU.
Requests stream (`/v1/completions`, greedy); reported: aggregate generated tokens/s over the
run's wall time, time to first token and end-to-end latency (p50/p99), errors (any non-200 or
broken stream) and 5xx, and our server's resident memory before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a refrigerator keeps food cold.",
    "Describe the city of Paris to someone who has never been there.",
    "List ten ideas for a rainy afternoon and say why each one is fun.",
    "Tell me about the history of the printing press.",
    "What should a beginner know before planting a vegetable garden?",
    "Summarize the plot of a mystery novel you would like to read.",
    "Give advice to a student preparing for their first job interview.",
]


@dataclass(slots=True)
class Result:
    tokens: int = 0
    errors: int = 0
    server_errors: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    wall: float = 0.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commit_of(checkout: Path) -> str:
    """The short commit a checkout's HEAD is at ("?" where git cannot say)."""
    git = ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "?"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def austen_ids(model: str, tokens: int) -> list[int]:
    """The first `tokens` tokens of Austen's first novel (one line), for long contexts."""
    from transformers import AutoTokenizer

    from cdlm_serve.train import austen

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(model)))
    text = austen.load(austen.NOVELS[0]).replace("\n", " ")
    return tokenizer(text, add_special_tokens=False).input_ids[:tokens]


def start(
    cmd: list[str],
    url: str,
    log: Path,
    timeout: float = 600,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
        env=env,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{cmd[0]} did not become healthy: see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(slots=True)
class Streamed:
    """One streamed request as its client saw it."""

    status: int
    text: str = ""
    usage: dict | None = None  # the last chunk's, with stream_options.include_usage
    ttft: float = 0.0  # seconds to the first text (the whole request's if none came)
    e2e: float = 0.0


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> Streamed | None:
    """POST a streaming completion or chat completion to `url + path` and read it to the end;
    None when the connection or a chunk broke."""
    started = time.perf_counter()
    first = None
    text, usage = [], None
    try:
        async with client.stream("POST", f"{url}{path}", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Streamed(r.status_code)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    piece = c.get("text") or (c.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError):
        return None
    done = time.perf_counter()
    return Streamed(200, "".join(text), usage, (first or done) - started, done - started)


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    count,
    result: Result,
    extra: dict | None = None,
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    out = await stream(client, url, "/v1/completions", body)
    if out is None or out.status != 200:
        result.errors += 1
        result.server_errors += out is not None and out.status >= 500
        return
    result.tokens += out.usage["completion_tokens"] if out.usage else count(out.text)
    result.ttft.append(out.ttft)
    result.e2e.append(out.e2e)


async def run_load(
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    duration: float,
    max_tokens: int,
    count,
    extra: dict | None = None,
) -> Result:
    result = Result()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    deadline = time.perf_counter() + duration if duration else None

    async def worker(client: httpx.AsyncClient) -> None:
        i = 0
        while True:
            if deadline is not None:
                if time.perf_counter() > deadline:
                    return
                i += 1
            else:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
            await one_request(
                client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens, count, result, extra
            )

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    result.wall = time.perf_counter() - started
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(r: Result) -> dict:
    return {
        "tok_s": round(r.tokens / r.wall, 2),
        "tokens": r.tokens,
        "requests": len(r.e2e),
        "errors": r.errors,
        "server_errors": r.server_errors,
        "wall_s": round(r.wall, 2),
        "ttft_p50": round(pct(r.ttft, 0.5), 3),
        "ttft_p99": round(pct(r.ttft, 0.99), 3),
        "e2e_p50": round(pct(r.e2e, 0.5), 3),
        "e2e_p99": round(pct(r.e2e, 0.99), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--soak", type=float, default=0.0, help="run ours for this many seconds")
    p.add_argument(
        "--peer",
        choices=["transformers", "llama.cpp", "none"],
        default="transformers",
        help="the server to compare with: transformers serve, or llama.cpp's llama-server "
        "(built from source once, bench/llama_cpp.py; bf16 and Q8_0 GGUF)",
    )
    p.add_argument(
        "--peer-kinds",
        nargs="+",
        default=["bf16", "Q8_0"],
        help="llama-server's GGUFs: bf16, Q8_0 (converted from our model's folder), source "
        "(a built-in model's own GGUF, e.g. Gemma 3 270M's Q4_K_M)",
    )
    p.add_argument("--no-peer", dest="peer", action="store_const", const="none")
    p.add_argument("--quantize", choices=["int8"], help="serve ours with int8 weights")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="equal work: every request generates max_tokens (ours and llama-server)",
    )
    p.add_argument(
        "--isa",
        choices=["native", "avx2", "avx512"],
        default="native",
        help="the CPU instruction set both run on: ours forced to it (--cpu-isa), llama-server "
        "built for it (bench/llama_cpp.py), so that the AVX2 comparison runs on any machine",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    folder = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(folder)

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    args.logs.mkdir(parents=True, exist_ok=True)
    out: dict = {
        "model": args.model,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "quantize": args.quantize,
        "isa": args.isa,
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = start(
        [
            sys.executable,
            "-m",
            "cdlm_serve.server.cli",
            "serve",
            "--model",
            f"m={folder}",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--max-batch",
            str(args.concurrency),
            "--log-level",
            "warning",
            "--cpu-isa",
            args.isa,
            *(["--quantize", args.quantize] if args.quantize else []),
        ],
        url,
        args.logs / "bench_load_ours.log",
    )
    try:
        asyncio.run(run_load(url, "m", args.concurrency, args.concurrency, 0, 8, count))  # warm
        rss_before = rss_mb(ours.pid)
        r = asyncio.run(
            run_load(
                url,
                "m",
                args.concurrency,
                args.requests,
                args.soak,
                args.max_tokens,
                count,
                {"ignore_eos": True} if args.ignore_eos else None,
            )
        )
        rss_after = rss_mb(ours.pid)
    finally:
        stop(ours)
    out["ours"] = summary(r)
    out["rss_mb_before"], out["rss_mb_after"] = round(rss_before, 1), round(rss_after, 1)
    out["rss_growth"] = round((rss_after - rss_before) / rss_before, 4)

    extra = {"ignore_eos": True} if args.ignore_eos else None
    out["peers"] = {}
    for name, cmd, model in _peers(args, folder):
        port = free_port()
        cmd = [c.replace("{port}", str(port)) for c in cmd]
        purl = f"http://127.0.0.1:{port}"
        peer = start(cmd, purl, args.logs / f"bench_load_{name.replace(' ', '_')}.log")
        try:
            asyncio.run(run_load(purl, model, args.concurrency, args.concurrency, 0, 8, count))
            pr = asyncio.run(
                run_load(
                    purl,
                    model,
                    args.concurrency,
                    args.requests,
                    0,
                    args.max_tokens,
                    count,
                    None if name == "transformers serve" else extra,
                )
            )
            rss = round(rss_mb(peer.pid), 1)
        finally:
            stop(peer)
        out["peers"][name] = {**summary(pr), "rss_mb": rss}
    ours_tok_s = out["ours"]["tok_s"]
    out.update(
        {
            "ours_tok_s": ours_tok_s,
            "ratios": {
                name: round(ours_tok_s / s["tok_s"], 2) if s["tok_s"] else None
                for name, s in out["peers"].items()
            },
            "errors": out["ours"]["errors"],
        }
    )
    _print(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def _peers(args: argparse.Namespace, folder: Path) -> list[tuple[str, list[str], str]]:
    """(name, command with {port}, the model name requests carry) of each peer to run."""
    if args.peer == "transformers":
        cmd = ["transformers", "serve", str(folder), "--continuous-batching", "--dtype",
               "bfloat16", "--device", "cpu", "--host", "127.0.0.1",
               "--port", "{port}"]  # fmt: skip
        return [("transformers serve", cmd, str(folder))]
    if args.peer == "llama.cpp":
        from cdlm_serve.bench import llama_cpp

        return [
            (f"llama-server {kind}", llama_cpp.server_command(
                llama_cpp.gguf(args.model, kind), 0, args.concurrency, isa=args.isa), "m")
            for kind in args.peer_kinds
        ]  # fmt: skip
    return []


def _print(out: dict) -> None:
    ours = "ours" + (f" ({out['quantize']})" if out.get("quantize") else " (bf16)")
    print(
        f"\nload: {out['model']}, concurrency {out['concurrency']}, max_tokens "
        f"{out['max_tokens']}, streaming, greedy, on CPU ({out['isa']})"
    )
    print(
        f"{'':22}{'tok/s':>8}{'TTFT p50/p99 (s)':>20}{'e2e p50/p99 (s)':>20}{'errors':>8}"
        f"{'RSS MB':>8}"
    )
    rows = [(ours, {**out["ours"], "rss_mb": out["rss_mb_after"]}), *out["peers"].items()]
    for name, s in rows:
        print(
            f"{name:22}{s['tok_s']:>8.1f}{s['ttft_p50']:>10.2f}/{s['ttft_p99']:<9.2f}"
            f"{s['e2e_p50']:>10.2f}/{s['e2e_p99']:<9.2f}{s['errors']:>8}{s['rss_mb']:>8.0f}"
        )
    for name, ratio in out["ratios"].items():
        print(f"ours / {name}: {ratio:.2f}x")
    print(
        f"our RSS {out['rss_mb_before']} MB -> {out['rss_mb_after']} MB "
        f"({100 * out['rss_growth']:+.1f}%)"
    )


if __name__ == "__main__":
    main()
