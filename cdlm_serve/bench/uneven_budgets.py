"""Decoding on compacted sessions: does a session compacted with non-uniform (`measured`)
budgets decode as fast as one compacted with uniform budgets to the same average size?

A non-uniform segment is as long as its longest head in the running batch row (the other heads'
extra slots are padding, a -inf bias: engine/sessions/ragged.py); the CPU decode kernel skips that
padding, so a head pays for its own slots only. Through a real server: `--sessions` sessions
per kind, each of `--context` Austen tokens compacted `--ratio`x with `--method` (uniform, then
the model's shipped `measured` schedule), then `--rounds` rounds of greedy completions of
`--max-tokens` tokens (ignore_eos, append false) at each concurrency, one session per client,
the two kinds alternating round by round. Reports the row length (the longest head), tok/s
medians and measured / uniform.

    python -m cdlm_serve.bench.uneven_budgets [--context 2048] [--ratio 10] [--concurrency 1 8]
                                              [--rounds 3] [--json out.json]
                                   [--checkout DIR]   # another checkout's server (before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cdlm_serve.bench.load import austen_ids, free_port, start, stop
from cdlm_serve.models.sources import DEFAULT_AR_MODEL

KINDS = ("uniform", "measured")


def _sessions(url: str, args: argparse.Namespace, ids: list[int]) -> dict[str, list[dict]]:
    """`--sessions` compacted sessions per kind, as the server describes them."""
    made: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    with httpx.Client(base_url=url, timeout=3600) as http:
        for kind in KINDS:
            for i in range(args.sessions):
                sid = f"{kind}-{i}"
                r = http.post("/v1/sessions", json={"model": args.model, "id": sid, "prompt": ids})
                r.raise_for_status()
                body = {"ratio": args.ratio, "method": args.method, "budgets": kind}
                http.post(f"/v1/sessions/{sid}/compact", json=body).raise_for_status()
                made[kind].append(http.get(f"/v1/sessions/{sid}").json())
    return made


async def _round(url: str, args: argparse.Namespace, kind: str, clients: int) -> float:
    """tok/s of `clients` concurrent completions, each on its own session of `kind`."""
    body = {
        "model": args.model,
        "prompt": " The",
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "append": False,
    }
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:

        async def one(i: int) -> int:
            r = await http.post("/v1/completions", json={**body, "session_id": f"{kind}-{i}"})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(clients)))
        return sum(tokens) / (time.perf_counter() - started)


def measure(url: str, args: argparse.Namespace) -> dict:
    ids = austen_ids(args.model, args.context)
    made = _sessions(url, args, ids)
    rows = []
    for clients in args.concurrency:
        speeds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        asyncio.run(_round(url, args, "uniform", clients))  # warm-up (kernels, allocator)
        for _ in range(args.rounds):
            for kind in KINDS:
                speeds[kind].append(asyncio.run(_round(url, args, kind, clients)))
        for kind in KINDS:
            rows.append(
                {
                    "kind": kind,
                    "clients": clients,
                    "row_slots": made[kind][0]["physical_tokens"],
                    "bytes_at_rest": made[kind][0]["bytes"],
                    "tok_s": round(statistics.median(speeds[kind]), 1),
                    "tok_s_all": [round(s, 1) for s in speeds[kind]],
                }
            )
    return {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}


def _print(result: dict) -> None:
    rows = result["rows"]
    head = f"{'budgets':<10}{'clients':>8}{'row slots':>10}{'MB at rest':>11}{'tok/s':>8}"
    print(f"{head}{'ratio':>7}")
    for row in rows:
        uniform = next(r for r in rows if r["clients"] == row["clients"] and r["kind"] == "uniform")
        print(
            f"{row['kind']:<10}{row['clients']:>8}{row['row_slots']:>10}"
            f"{row['bytes_at_rest'] / 1e6:>11.1f}{row['tok_s']:>8.1f}"
            f"{row['tok_s'] / uniform['tok_s']:>7.2f}"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=10)
    p.add_argument("--method", default="am-highest-fast")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--checkout", type=Path, help="run this checkout's server")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.sessions = max(args.concurrency)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="cdlm-uneven-") as scratch:
        cmd = [sys.executable, "-m", "cdlm_serve.server.cli", "serve", "--port", str(port)]
        cmd += ["--model", args.model, "--sessions-dir", scratch, "--no-prefix-caching"]
        proc = start(cmd, url, Path(scratch) / "server.log", cwd=args.checkout)
        try:
            result = measure(url, args)
        finally:
            stop(proc)
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
