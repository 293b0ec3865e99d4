"""Automatic prefix caching on a chat workload: every request carries the same ~1K-token
system prompt (Austen) and a question of its own; concurrent clients stream chat completions.
Our server runs twice on the same model, requests and machine, one run after the other: with
prefix caching (the default) and with `--no-prefix-caching`.

    python -m cdlm_serve.bench.prefix_cache [--clients 8] [--requests 32] [--system-tokens 1024]
                                            [--max-tokens 32] [--json out.json]

Each run is warmed by one request first (a server that has been up for a while has seen its
system prompt; the warm-up also seeds the cache). Reported per run: TTFT p50/p99, end-to-end
p50/p99, generated tokens/s over the run's wall time, the share of prompt tokens served from
the cache (from `usage.prompt_tokens_details.cached_tokens`), errors; and how many answers
were the same text in both runs (greedy bf16: a cached prefix's K/V were computed in another
batch, so an argmax near a tie may flip; fp32 equality is tests/test_prefix_cache.py's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cdlm_serve.bench.load import austen_ids, free_port, pct, rss_mb, start, stop, stream
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve

QUESTIONS = [
    "Who is the eldest sister, and what is she like?",
    "Summarize the opening chapter in two sentences.",
    "What does Mrs. Dashwood decide to do, and why?",
    "Describe John Dashwood's character.",
    "What promise does John make to his father?",
    "How does Fanny Dashwood persuade her husband?",
    "Which sister is the more romantic one?",
    "Where do the Dashwood women end up living?",
]


@dataclass(slots=True)
class Run:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    answers: dict[int, str] = field(default_factory=dict)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    wall: float = 0.0


async def _one(
    client: httpx.AsyncClient, url: str, system: str, i: int, max_tokens: int, run: Run
) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"({i}) {QUESTIONS[i % len(QUESTIONS)]}"},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = await stream(client, url, "/v1/chat/completions", body)
    if out is None or out.status != 200 or out.usage is None:
        run.errors += 1
        return
    run.ttft.append(out.ttft)
    run.e2e.append(out.e2e)
    run.answers[i] = out.text
    run.tokens += out.usage["completion_tokens"]
    run.prompt_tokens += out.usage["prompt_tokens"]
    run.cached_tokens += out.usage["prompt_tokens_details"]["cached_tokens"]


async def _load(url: str, system: str, clients: int, requests: int, max_tokens: int) -> Run:
    run = Run()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await _one(client, url, system, queue.get_nowait(), max_tokens, run)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=900) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    run.wall = time.perf_counter() - started
    return run


def _serve(folder: Path, clients: int, caching: bool, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "cdlm_serve.server.cli", "serve", "--model", f"m={folder}",
        "--port", str(port), "--dtype", "bfloat16", "--device", "cpu",
        "--max-batch", str(clients), "--log-level", "warning",
    ]  # fmt: skip
    if not caching:
        cmd.append("--no-prefix-caching")
    name = "cached" if caching else "uncached"
    return start(cmd, url, logs / f"bench_prefix_cache_{name}.log"), url


def _summary(run: Run, rss: float) -> dict:
    return {
        "requests": len(run.e2e),
        "errors": run.errors,
        "ttft_p50": round(pct(run.ttft, 0.5), 3),
        "ttft_p99": round(pct(run.ttft, 0.99), 3),
        "e2e_p50": round(pct(run.e2e, 0.5), 3),
        "e2e_p99": round(pct(run.e2e, 0.99), 3),
        "tok_s": round(run.tokens / run.wall, 2),
        "prompt_tokens": run.prompt_tokens,
        "cached_share": round(run.cached_tokens / max(1, run.prompt_tokens), 3),
        "rss_mb": round(rss, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    folder = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    system = "You answer questions about this text.\n\n" + tok.decode(
        austen_ids(args.model, args.system_tokens)
    )
    out: dict = {
        "model": args.model,
        "clients": args.clients,
        "requests": args.requests,
        "system_tokens": len(tok(system, add_special_tokens=False).input_ids),
        "max_tokens": args.max_tokens,
    }
    runs: dict[str, Run] = {}
    for caching in (True, False):
        proc, url = _serve(folder, args.clients, caching, args.logs)
        try:
            asyncio.run(_load(url, system, 1, 1, 4))  # warm-up: one request
            run = asyncio.run(_load(url, system, args.clients, args.requests, args.max_tokens))
            rss = rss_mb(proc.pid)
        finally:
            stop(proc)
        name = "cached" if caching else "uncached"
        runs[name] = run
        out[name] = _summary(run, rss)
    same = sum(runs["cached"].answers.get(i) == a for i, a in runs["uncached"].answers.items())
    out["same_answers"] = same
    out["ttft_p50_speedup"] = round(out["uncached"]["ttft_p50"] / out["cached"]["ttft_p50"], 2)
    out["tok_s_ratio"] = round(out["cached"]["tok_s"] / out["uncached"]["tok_s"], 2)
    _print(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def _print(out: dict) -> None:
    print(
        f"\nprefix cache: {out['model']}, {out['clients']} clients, {out['requests']} chat "
        f"requests, a shared {out['system_tokens']}-token system prompt, max_tokens "
        f"{out['max_tokens']}, streaming, greedy, bf16 on CPU"
    )
    print(
        f"{'':12}{'TTFT p50/p99 (s)':>20}{'e2e p50/p99 (s)':>20}{'tok/s':>8}{'cached':>8}"
        f"{'errors':>8}{'RSS MB':>8}"
    )
    for name in ("cached", "uncached"):
        s = out[name]
        print(
            f"{name:12}{s['ttft_p50']:>10.2f}/{s['ttft_p99']:<9.2f}{s['e2e_p50']:>10.2f}/"
            f"{s['e2e_p99']:<9.2f}{s['tok_s']:>8.1f}{s['cached_share']:>8.2f}{s['errors']:>8}"
            f"{s['rss_mb']:>8.0f}"
        )
    print(
        f"TTFT p50 {out['ttft_p50_speedup']}x lower with the cache, tok/s "
        f"{out['tok_s_ratio']}x; same answer text in both runs: {out['same_answers']}/"
        f"{out['uncached']['requests']}"
    )


if __name__ == "__main__":
    main()
