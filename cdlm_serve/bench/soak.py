"""A long mixed soak: does the server's memory plateau, or creep?

bench/mixed.py's mix (AR completions streamed and not, DLM completions in the three decodings,
the session loop create -> compact 10x -> continue -> delete), all at once for `--minutes`,
against a fresh server with both default models. Every 10 s it samples the server's RSS (and
its anonymous / file-backed parts, from /proc) and the byte counts the server reports itself
at /metrics (every `cdlm_serve:*_bytes` gauge: batch KV caches, sessions in memory, the
prefix cache, ...), so a growing RSS can be set against what the server knows it holds.

The goal (issue 42): once the first `--settle-minutes` (5) have passed, RSS grows < 2% to the
end, with 0 errors. Idle samples after the load (`--idle-seconds`) say what the server keeps
at rest: the goal is within 5% of the fresh server.

    python -m cdlm_serve.bench.soak [--minutes 30] [--settle-minutes 5] [--json soak.json]
                                    [--plot soak.png] [--checkout DIR] [--server-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cdlm_serve.bench.load import commit_of, stop
from cdlm_serve.bench.mixed import PHASES, RssSampler, add_server_args, start_server

GOAL_GROWTH_PCT = 2.0
GOAL_IDLE_PCT = 5.0  # idle after the load, against the fresh server before it
# The verdict's two levels are medians over this many seconds: several periods of the mix's
# session loop (create 1.5K tokens -> compact -> continue -> delete), whose phases swing RSS by
# 400-800 MB in float32. Over one minute, shorter than a float32 loop (~80 s on 2 cores), the
# median says which phase the minute caught: the same server read +23% and -17% (issue 59).
MEDIAN_S = 300.0


def proc_memory_mb(pid: int) -> dict[str, float]:
    """RssAnon (heap, tensors: what a leak grows) and RssFile (mapped weights, libraries)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key.lower().replace("rss", "rss_") + "_mb"] = round(int(rest.split()[0]) / 1024, 1)
    return out


def server_bytes(metrics_text: str) -> dict[str, float]:
    """MB of each `cdlm_serve:*_bytes` gauge at /metrics, summed over its labels (models)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "gauge" or not family.name.startswith("cdlm_serve:"):
            continue
        if not family.name.endswith("_bytes") or "disk" in family.name:
            continue
        name = family.name.removeprefix("cdlm_serve:").removesuffix("_bytes") + "_mb"
        out[name] = round(sum(s.value for s in family.samples) / 2**20, 1)
    return out


class MemorySampler(RssSampler):
    """RSS as bench.mixed samples it, plus /proc's split and the server's own byte counts."""

    def __init__(self, pid: int, url: str, every: float = 10.0):
        super().__init__(pid, every)
        self.url = url

    def sample(self) -> float:
        mb = super().sample()
        row = self.samples[-1]
        row |= proc_memory_mb(self.pid)
        try:
            row |= server_bytes(httpx.get(f"{self.url}/metrics", timeout=30).text)
        except httpx.HTTPError:
            row["metrics_error"] = True  # a busy server may answer late: the RSS still counts
        return mb


def at(samples: list[dict], seconds: float) -> dict:
    """The first sample at or after `seconds` (the last one if the run was shorter)."""
    return next((s for s in samples if s["t_s"] >= seconds), samples[-1])


def median_rss(samples: list[dict], after_s: float, until_s: float) -> float:
    """The median RSS of the samples with after_s <= t_s <= until_s."""
    return statistics.median(s["rss_mb"] for s in samples if after_s <= s["t_s"] <= until_s)


def verdict(samples: list[dict], settle_s: float, errors: int, window_s: float = MEDIAN_S) -> dict:
    """Growth from the window after settling to the last window under load, each level the
    median RSS over its `window_s`: the session loop and the trims after each delete swing RSS
    within seconds, and a single sample falling in a dip (or on a peak) decided the verdict.
    The single samples stay beside the medians, for comparison with older runs."""
    load = [s for s in samples if s["phase"] == "load"]
    settled_sample, end_sample = at(load, settle_s), load[-1]
    first, last = settled_sample["t_s"], end_sample["t_s"]
    # Open on the far side: a minute of 10 s samples is 6 of them, not 7.
    settled = median_rss(load, first, first + window_s - 1e-6)
    end = median_rss(load, max(first, last - window_s + 1e-6), last)
    growth = 100 * (end - settled) / settled
    idle = 100 * (samples[-1]["rss_mb"] - samples[0]["rss_mb"]) / samples[0]["rss_mb"]
    return {
        "rss_start_mb": samples[0]["rss_mb"],
        "median_window_s": window_s,
        "settled_at_s": first,
        "rss_settled_mb": round(settled, 1),  # the median of the window from settled_at_s
        "rss_end_mb": round(end, 1),  # the median of the last window under load
        "rss_settled_sample_mb": settled_sample["rss_mb"],
        "rss_end_sample_mb": end_sample["rss_mb"],
        "rss_max_mb": max(s["rss_mb"] for s in load),
        "rss_idle_after_mb": samples[-1]["rss_mb"],
        "growth_after_settle_pct": round(growth, 2),
        "idle_over_start_pct": round(idle, 2),
        "errors": errors,
        "goal_met": growth < GOAL_GROWTH_PCT and errors == 0,
        "idle_goal_met": idle < GOAL_IDLE_PCT,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.plot(minutes, [s["rss_mb"] for s in samples], label="RSS", linewidth=2)
    if all("rss_anon_mb" in s for s in samples):
        ax.plot(minutes, [s["rss_anon_mb"] for s in samples], label="RSS anonymous")
    counted = sorted({k for s in samples for k in s if k.endswith("_mb") and "rss" not in k})
    for key in counted:
        ys = [s.get(key, float("nan")) for s in samples]
        ax.plot(minutes, ys, linestyle="--", label=f"server: {key.removesuffix('_mb')}")
    ax.axvline(result["verdict"]["settled_at_s"] / 60, color="grey", linestyle=":")
    v = result["verdict"]
    ax.set_title(
        f"RSS {v['median_window_s'] / 60:g}-min medians: {v['rss_settled_mb']:.0f} MB from "
        f"{v['settled_at_s'] / 60:.1f} min"
        f" -> {v['rss_end_mb']:.0f} MB in the last ({v['growth_after_settle_pct']:+.2f}%), "
        f"{v['errors']} errors"
    )
    ax.set_xlabel("minutes (server started at 0)")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.text(0.01, 0.01, result["label"], fontsize=7, color="grey")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print(result: dict) -> None:
    v = result["verdict"]
    print(f"{'kind':<11}{'req':>7}{'tok/s':>8}{'err':>5}{'5xx':>5}")
    for kind, r in result["load"].items():
        if isinstance(r, dict):
            print(f"{kind:<11}{r['requests']:>7}{r['tok_s']:>8.1f}{r['errors']:>5}{r['5xx']:>5}")
    last = [s for s in result["samples"] if s["phase"] == "load"][-1]
    print("server's own counts at the end (MB):", {k: v for k, v in last.items() if "_mb" in k})
    print(
        f"RSS MB: fresh {v['rss_start_mb']}; {v['median_window_s'] / 60:g}-min medians: from "
        f"{v['settled_at_s']:.0f} s {v['rss_settled_mb']}, last window {v['rss_end_mb']} (single "
        "samples "
        f"{v['rss_settled_sample_mb']}, {v['rss_end_sample_mb']}); max {v['rss_max_mb']}, "
        f"idle after {v['rss_idle_after_mb']}"
    )
    print(
        f"growth after settling: {v['growth_after_settle_pct']:+.2f}% (goal < "
        f"{GOAL_GROWTH_PCT}%), errors: {v['errors']} -> goal {'met' if v['goal_met'] else 'MISSED'}"
    )
    print(
        f"idle after the load: {v['idle_over_start_pct']:+.2f}% over the fresh server (goal < "
        f"{GOAL_IDLE_PCT}%) -> {'met' if v['idle_goal_met'] else 'MISSED'}"
    )


def census_env(args: argparse.Namespace) -> dict[str, str] | None:
    """The server's environment with census/sitecustomize.py imported at its start (in any
    checkout: the file imports nothing of cdlm_serve), or None for the plain one."""
    if args.census is None:
        return None
    args.census.unlink(missing_ok=True)
    here = str(Path(__file__).parent / "census")
    path = os.environ.get("PYTHONPATH")
    return os.environ | {
        "PYTHONPATH": here + (os.pathsep + path if path else ""),
        "CDLM_SOAK_CENSUS": str(args.census.resolve()),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--settle-minutes", type=float, default=5, help="growth is counted after")
    p.add_argument("--every", type=float, default=10, help="seconds between samples")
    p.add_argument(
        "--median-minutes", type=float, default=MEDIAN_S / 60, help="each level's window"
    )
    p.add_argument("--idle-seconds", type=float, default=70, help="sampled after the load")
    p.add_argument("--plot", type=Path, help="a PNG of RSS (and the server's counts) over time")
    p.add_argument(
        "--census",
        type=Path,
        help="a JSON-lines file: once a minute the server appends what it holds (every tensor "
        "Python can reach, by storage; malloc's counts; who holds the largest new ones)",
    )
    p.add_argument(
        "--census-trace",
        action="store_true",
        help="with --census: trace Python's allocations (tracemalloc) from the fresh sample on, "
        "and list the lines whose allocations grew since in each census (slows the server)",
    )
    args = p.parse_args(argv)
    if args.census_trace and args.census is None:
        p.error("--census-trace needs --census")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Said before a half-hour run, not as a traceback after it.
        p.error("--plot needs matplotlib: pip install -e '.[bench]'")

    with tempfile.TemporaryDirectory() as scratch:
        soak, server = start_server(args, Path(scratch), "bench_soak_server.log", census_env(args))
        try:
            sampler = MemorySampler(server.pid, soak.url, args.every)
            sampler.sample()  # fresh, before any request
            if args.census_trace:
                server.send_signal(signal.SIGUSR2)  # census/sitecustomize.py: _start_trace
            sampler.phase = "load"
            sampler.start()
            load = asyncio.run(soak.phase(tuple(PHASES["mix"]), 60 * args.minutes))
            sampler.stop()
            sampler.join()
            sampler.phase = "idle"
            # What the server keeps once nothing runs: long enough for its idle housekeeping
            # (the heap's periodic trim, the engines' idle release) to have run.
            for _ in range(max(1, round(args.idle_seconds / args.every))):
                time.sleep(args.every)
                sampler.sample()
        finally:
            stop(server)
    errors = sum(r["errors"] for r in load.values() if isinstance(r, dict))
    result = {
        "checkout": str(args.checkout.resolve()),
        "server_args": args.server_args,
        "minutes": args.minutes,
        "label": f"bench.soak --minutes {args.minutes:g} {args.server_args}, "
        f"checkout {args.checkout.resolve()} @ {commit_of(args.checkout)}",
        "load": load,
        "samples": sampler.samples,
        "verdict": verdict(
            sampler.samples, 60 * args.settle_minutes, errors, 60 * args.median_minutes
        ),
    }
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
