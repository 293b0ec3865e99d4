"""What a long session's compaction costs the other requests of its model: a greedy stream runs
alone, then again while a session of `--tokens` tokens (Jane Austen) is compacted, on a real
server. Prints the stream's inter-token gaps (p50 / p99 / max) alone and during the compaction,
the compaction's time, its pieces of engine work and the longest of them.

    python -m cdlm_serve.bench.compaction_stall [--tokens 8000] [--ratio 10]
                                                [--method am-highest-fast] [--alone]
                                                [--server-args "--max-batch 4"] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from cdlm_serve.bench.load import austen_ids, free_port, start, stop
from cdlm_serve.models.sources import DEFAULT_AR_MODEL


def _gaps(base: str, model: str, tokens: int) -> list[float]:
    """Seconds between the chunks of one greedy stream."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    stamps = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


def _summary(gaps: list[float]) -> dict[str, float]:
    ordered = sorted(gaps)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": 1000 * ordered[-1],
        "tokens": len(ordered) + 1,
    }


def _measure(base: str, args: argparse.Namespace, ids: list[int]):
    """(compaction report, seconds to create the session, gaps alone, gaps during)."""
    _gaps(base, args.model, 8)  # warm-up
    alone = _gaps(base, args.model, args.stream_tokens)
    started = time.perf_counter()
    r = httpx.post(
        f"{base}/v1/sessions",
        json={"model": args.model, "id": "stall", "prompt": ids},
        timeout=3600,
    )
    r.raise_for_status()
    created = time.perf_counter() - started
    report: dict = {}

    def compact() -> None:
        body = {"ratio": args.ratio, "method": args.method}
        body["query_source"] = args.query_source
        resp = httpx.post(f"{base}/v1/sessions/stall/compact", json=body, timeout=7200)
        resp.raise_for_status()
        report.update(resp.json())

    worker = threading.Thread(target=compact)
    worker.start()
    during: list[float] = []
    while worker.is_alive():  # streams back to back for as long as the compaction runs
        during += _gaps(base, args.model, args.stream_tokens)
    worker.join()
    if args.alone:  # the same compaction again, with nothing else running
        httpx.delete(f"{base}/v1/sessions/stall", timeout=60).raise_for_status()
        body = {"model": args.model, "id": "stall", "prompt": ids}
        httpx.post(f"{base}/v1/sessions", json=body, timeout=3600).raise_for_status()
        body = {"ratio": args.ratio, "method": args.method, "query_source": args.query_source}
        resp = httpx.post(f"{base}/v1/sessions/stall/compact", json=body, timeout=7200)
        resp.raise_for_status()
        report["alone_seconds"] = resp.json()["seconds"]["total"]
    return report, created, alone, during


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--tokens", type=int, default=8000, help="session length")
    p.add_argument("--ratio", type=float, default=10)
    p.add_argument("--method", default="am-highest-fast")
    p.add_argument("--query-source", default="repeat")
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--alone", action="store_true", help="also time the compaction alone")
    p.add_argument("--server-args", default="", help="extra cdlm-serve flags, one string")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    ids = austen_ids(args.model, args.tokens)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, "-m", "cdlm_serve.server.cli", "serve", "--port", str(port)]
        cmd += ["--model", args.model, "--dtype", args.dtype, "--sessions-dir", scratch]
        cmd += args.server_args.split()
        server = start(cmd, base, Path(scratch) / "server.log")
        try:
            report, created, alone, during = _measure(base, args, ids)
        finally:
            stop(server)
    rows = {"alone": _summary(alone), "during compaction": _summary(during)}
    print(f"session of {len(ids)} tokens created (prefilled in chunks) in {created:.1f} s")
    print(
        f"compaction {args.method} x{args.ratio}: {report['seconds']['total']:.1f} s "
        f"(queries {report['seconds'].get('queries', 0):.1f} s), "
        f"{report['engine_jobs']} pieces of engine work, the longest "
        f"{1000 * report['engine_seconds_max']:.0f} ms"
    )
    if "alone_seconds" in report:
        print(
            f"the same compaction alone: {report['alone_seconds']:.1f} s (under the streams "
            f"{report['seconds']['total'] / report['alone_seconds']:.2f}x as long)"
        )
    print(f"{'stream':<20}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'tokens':>8}")
    for name, row in rows.items():
        print(
            f"{name:<20}{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}{row['max_ms']:>10.1f}"
            f"{row['tokens']:>8}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "session_tokens": len(ids),
                    "create_seconds": created,
                    "compaction": {
                        k: report.get(k)
                        for k in (
                            "seconds",
                            "engine_jobs",
                            "engine_seconds_max",
                            "ratio",
                            "alone_seconds",
                        )
                    },
                    "stream": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
