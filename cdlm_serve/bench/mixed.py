"""A mixed soak on a real server with both default models: does any kind of work starve another,
and does the server come back to its fresh speed and memory afterwards?

Kinds of client (each a loop of requests, started together, stopped at the phase's deadline):
  ar         4 greedy AR completions at a time, not streamed (48 tokens, ignore_eos)
  ar-stream  2 greedy AR streams (48 tokens): TTFT and inter-token gaps
  dlm        3 diffusion completions at a time, one per decoding (cdlm, fast_dllm, vanilla)
  session    1 loop: create a session of Austen (1.5K tokens) -> compact 10x -> continue -> delete

Phases, in order: `ar` (AR alone: the "before"), `dlm` (DLM alone), `ar+dlm` (the two models
at once: fair share), `mix` (everything), `after` (AR alone again). RSS is sampled every 10 s.
Ratios in the JSON: AR under ar+dlm and under mix / AR alone, DLM likewise, after / before.

    python -m cdlm_serve.bench.mixed [--phase-seconds 40] [--mix-seconds 90] [--json out.json]
                          [--checkout DIR]   # run the server of another checkout (before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cdlm_serve.bench.load import PROMPTS, austen_ids, free_port, pct, rss_mb, start, stop
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, DEFAULT_DLM_MODEL

DECODINGS = ("cdlm", "fast_dllm", "vanilla")  # the built-in modes (engine.decoding.dlm_modes.MODES)
PHASES = {
    "ar": ("ar", "ar-stream"),
    "dlm": ("dlm",),
    "ar+dlm": ("ar", "ar-stream", "dlm"),
    "mix": ("ar", "ar-stream", "dlm", "session"),
    "after": ("ar", "ar-stream"),
}


@dataclass(slots=True)
class Tally:
    """What one kind of client got in one phase."""

    requests: int = 0
    tokens: int = 0
    errors: int = 0
    server_errors: int = 0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # between two streamed chunks
    stages: dict[str, list[float]] = field(default_factory=dict)  # session loop: seconds

    def failed(self, status: int | None) -> None:
        self.errors += 1
        self.server_errors += status is not None and status >= 500

    def summary(self, wall: float) -> dict:
        ms = lambda v, q: round(1000 * pct(v, q), 1) if v else None  # noqa: E731
        out = {
            "requests": self.requests,
            "tokens": self.tokens,
            "tok_s": round(self.tokens / wall, 2),
            "errors": self.errors,
            "5xx": self.server_errors,
            "e2e_p50_ms": ms(self.e2e, 0.5),
            "e2e_p99_ms": ms(self.e2e, 0.99),
        }
        if self.ttft:
            out |= {"ttft_p50_ms": ms(self.ttft, 0.5), "ttft_p99_ms": ms(self.ttft, 0.99)}
        if self.gaps:
            out |= {
                "itl_p50_ms": ms(self.gaps, 0.5),
                "itl_p99_ms": ms(self.gaps, 0.99),
                "itl_max_ms": round(1000 * max(self.gaps), 1),
            }
        if self.stages:
            out["stage_median_s"] = {
                k: round(statistics.median(v), 2) for k, v in self.stages.items()
            }
        return out


@dataclass
class Soak:
    url: str
    ar_model: str
    dlm_model: str
    session_ids: list[int]
    ar_tokens: int = 48
    dlm_tokens: int = 32

    async def completion(
        self, client: httpx.AsyncClient, body: dict, tally: Tally, prompt: int
    ) -> None:
        body = {"prompt": PROMPTS[prompt % len(PROMPTS)], "temperature": 0} | body
        started = time.perf_counter()
        try:
            r = await client.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError:
            tally.failed(None)
            return
        if r.status_code != 200:
            tally.failed(r.status_code)
            return
        tally.requests += 1
        tally.tokens += r.json()["usage"]["completion_tokens"]
        tally.e2e.append(time.perf_counter() - started)

    async def stream(self, client: httpx.AsyncClient, tally: Tally, prompt: int) -> None:
        body = {"model": self.ar_model, "prompt": PROMPTS[prompt % len(PROMPTS)]}
        body |= {"max_tokens": self.ar_tokens, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        stamps: list[float] = []
        tokens = 0
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.failed(r.status_code)
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        stamps.append(time.perf_counter())
                    if chunk.get("error"):
                        tally.failed(500)
                        return
        except (httpx.HTTPError, json.JSONDecodeError):
            tally.failed(None)
            return
        done = time.perf_counter()
        tally.requests += 1
        tally.tokens += tokens
        tally.e2e.append(done - started)
        tally.ttft.append((stamps[0] if stamps else done) - started)
        tally.gaps += [b - a for a, b in itertools.pairwise(stamps)]

    async def session(self, client: httpx.AsyncClient, tally: Tally, n: int) -> None:
        sid = f"soak-{n}"
        steps = [
            ("create", "POST", "/v1/sessions", {"model": self.ar_model, "id": sid}),
            ("compact", "POST", f"/v1/sessions/{sid}/compact", {"ratio": 10}),
            ("continue", "POST", "/v1/completions", {"model": self.ar_model}),
            ("delete", "DELETE", f"/v1/sessions/{sid}", None),
        ]
        steps[0][3]["prompt"] = self.session_ids
        steps[1][3]["method"] = "am-highest-fast"
        steps[2][3].update(
            session_id=sid, prompt="\n\nWho is the heroine?", max_tokens=16, temperature=0
        )
        started = time.perf_counter()
        for name, method, path, body in steps:
            t0 = time.perf_counter()
            try:
                r = await client.request(method, f"{self.url}{path}", json=body)
            except httpx.HTTPError:
                tally.failed(None)
                return
            if r.status_code not in (200, 201):
                tally.failed(r.status_code)
                if name != "delete":  # leave nothing behind for the next loop
                    await client.delete(f"{self.url}/v1/sessions/{sid}")
                return
            tally.stages.setdefault(name, []).append(time.perf_counter() - t0)
            if name == "continue":
                tally.tokens += r.json()["usage"]["completion_tokens"]
        tally.requests += 1
        tally.e2e.append(time.perf_counter() - started)

    async def phase(self, kinds: tuple[str, ...], seconds: float) -> dict:
        tallies = {k: Tally() for k in kinds}
        deadline = time.perf_counter() + seconds
        counter = itertools.count()

        async def loop(make) -> None:
            while time.perf_counter() < deadline:
                await make(next(counter))

        async with httpx.AsyncClient(timeout=900) as client:
            workers = []
            if "ar" in kinds:
                ar_body = {"model": self.ar_model, "max_tokens": self.ar_tokens}
                ar_body["ignore_eos"] = True
                # The body is bound now: a closure over a name the DLM loop below reassigns
                # sent DLM requests as "ar" (every ar+dlm and mix phase before this fix).
                workers += [
                    loop(lambda i, b=ar_body: self.completion(client, b, tallies["ar"], i))
                    for _ in range(4)
                ]
            if "ar-stream" in kinds:
                workers += [
                    loop(lambda i: self.stream(client, tallies["ar-stream"], i)) for _ in range(2)
                ]
            if "dlm" in kinds:
                for decoding in DECODINGS:
                    body = {"model": self.dlm_model, "max_tokens": self.dlm_tokens}
                    body |= {"decoding": decoding, "ignore_eos": True}
                    workers.append(
                        loop(lambda i, b=body: self.completion(client, b, tallies["dlm"], i))
                    )
            if "session" in kinds:
                workers.append(loop(lambda i: self.session(client, tallies["session"], i)))
            started = time.perf_counter()
            await asyncio.gather(*workers)
            wall = time.perf_counter() - started
        return {"wall_s": round(wall, 1)} | {k: t.summary(wall) for k, t in tallies.items()}


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 10.0):
        super().__init__(daemon=True)
        self.pid, self.every, self.phase = pid, every, "start"
        self.samples: list[dict] = []
        self.started_at = time.perf_counter()
        self._halt = threading.Event()  # not _stop: Thread.join calls its own _stop

    def sample(self) -> float:
        mb = round(rss_mb(self.pid), 1)
        t = round(time.perf_counter() - self.started_at, 1)
        self.samples.append({"t_s": t, "phase": self.phase, "rss_mb": mb})
        return mb

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.sample()

    def stop(self) -> None:
        self._halt.set()


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _ar_tok_s(row: dict) -> float:
    return row["ar"]["tok_s"] + row["ar-stream"]["tok_s"]


def ratios(phases: dict, rss: dict) -> dict:
    ar, dlm = _ar_tok_s(phases["ar"]), phases["dlm"]["dlm"]["tok_s"]
    return {
        "ar_under_dlm_over_ar_alone": _ratio(_ar_tok_s(phases["ar+dlm"]), ar),
        "dlm_under_ar_over_dlm_alone": _ratio(phases["ar+dlm"]["dlm"]["tok_s"], dlm),
        "ar_under_mix_over_ar_alone": _ratio(_ar_tok_s(phases["mix"]), ar),
        "dlm_under_mix_over_dlm_alone": _ratio(phases["mix"]["dlm"]["tok_s"], dlm),
        "after_over_before_tok_s": _ratio(_ar_tok_s(phases["after"]), ar),
        "after_over_before_rss": _ratio(rss["after"], rss["before"]),
    }


def _print(result: dict) -> None:
    head = f"{'phase':<8}{'kind':<11}{'req':>5}{'tok/s':>8}{'err':>5}{'5xx':>5}"
    head += f"{'e2e p50':>9}{'p99':>8}{'ttft p50':>9}{'p99':>8}{'itl p50':>8}{'p99':>7}{'max':>7}"
    print(head)
    for phase, row in result["phases"].items():
        for kind in PHASES[phase]:
            r = row[kind]
            cells = [r.get(k) for k in ("e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms")]
            cells += [r.get(k) for k in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms")]
            widths = (9, 8, 9, 8, 8, 7, 7)
            text = "".join(
                ("-" if c is None else f"{c:.0f}").rjust(w)
                for c, w in zip(cells, widths, strict=True)
            )
            print(
                f"{phase:<8}{kind:<11}{r['requests']:>5}{r['tok_s']:>8.1f}{r['errors']:>5}"
                f"{r['5xx']:>5}{text}"
            )
            if "stage_median_s" in r:
                print(f"{'':<19}session loop stages (median s): {r['stage_median_s']}")
    print("RSS MB:", {k: v for k, v in result["rss_mb"].items()})
    for k, v in result["ratios"].items():
        print(f"{k:<32}{v}")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags bench.mixed and bench.soak share: which server, its models, where it logs."""
    p.add_argument("--ar-model", default=DEFAULT_AR_MODEL)
    p.add_argument("--dlm-model", default=DEFAULT_DLM_MODEL)
    p.add_argument("--session-tokens", type=int, default=1500)
    p.add_argument("--checkout", type=Path, default=Path.cwd(), help="whose server to run")
    p.add_argument("--server-args", default="", help="extra cdlm-serve flags, one string")
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, default=Path("/tmp"), help="where server.log goes")


def start_server(
    args: argparse.Namespace,
    sessions_dir: Path,
    log_name: str,
    env: dict[str, str] | None = None,
) -> tuple[Soak, subprocess.Popen]:
    """Start `args.checkout`'s server on both models (sessions in `sessions_dir`) and return
    the clients for it with the process; the caller stops it (bench.load.stop)."""
    session_ids = austen_ids(args.ar_model, args.session_tokens)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cdlm_serve.server.cli", "serve", "--port", str(port)]
    cmd += ["--model", args.ar_model, "--model", args.dlm_model]
    cmd += ["--sessions-dir", str(sessions_dir), "--log-level", "warning"]
    cmd += args.server_args.split()
    args.logs.mkdir(parents=True, exist_ok=True)
    server = start(cmd, url, args.logs / log_name, cwd=args.checkout, env=env)
    return Soak(url, args.ar_model, args.dlm_model, session_ids), server


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--phase-seconds", type=float, default=40)
    p.add_argument("--mix-seconds", type=float, default=90)
    p.add_argument("--phases", default=",".join(PHASES), help="which phases, comma-separated")
    p.add_argument("--warmup-seconds", type=float, default=20, help="the mix, not counted")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        soak, server = start_server(args, Path(scratch), "bench_mixed_server.log")
        try:
            # Warm-up, not counted: every path runs, caches and allocator pools reach their size.
            asyncio.run(soak.phase(tuple(PHASES["mix"]), args.warmup_seconds))
            sampler = RssSampler(server.pid)
            sampler.start()
            phases, rss = {}, {}
            for name in args.phases.split(","):
                kinds = PHASES[name]
                sampler.phase = name
                seconds = args.mix_seconds if name == "mix" else args.phase_seconds
                phases[name] = asyncio.run(soak.phase(kinds, seconds))
                print(f"{name}: done in {phases[name]['wall_s']} s", flush=True)
                if name == "ar":
                    rss["before"] = sampler.sample()
                if name == "after":
                    time.sleep(10)  # idle: what the server keeps once nothing runs
                    rss["after"] = sampler.sample()
            sampler.stop()
        finally:
            stop(server)
    result = {
        "checkout": str(args.checkout.resolve()),
        "phases": phases,
        "rss_mb": rss,
        "rss_samples": sampler.samples,
        "ratios": ratios(phases, rss) if set(PHASES) <= set(phases) else {},
    }
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
