"""bench/soak.py's reading of /metrics and its verdict; bench/mixed.py's RSS sampler stops."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from cdlm_serve.bench import soak
from cdlm_serve.bench.mixed import RssSampler

METRICS = """\
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.5e+09
# TYPE cdlm_serve:kv_cache_bytes gauge
cdlm_serve:kv_cache_bytes{model_name="a"} 1048576.0
cdlm_serve:kv_cache_bytes{model_name="b"} 2097152.0
# TYPE cdlm_serve:session_disk_bytes gauge
cdlm_serve:session_disk_bytes 9e+09
# TYPE cdlm_serve:heap_trim_released_bytes_total counter
cdlm_serve:heap_trim_released_bytes_total 5e+08
# TYPE cdlm_serve:sessions gauge
cdlm_serve:sessions 3.0
"""


def test_server_bytes_sums_each_gauge_over_models_and_skips_the_rest():
    # Disk is not memory, a counter is not a level, and a count is not bytes.
    assert soak.server_bytes(METRICS) == {"kv_cache_mb": 3.0}


def _samples(rss: list[float]) -> list[dict]:
    rows = [{"t_s": 0.0, "phase": "start", "rss_mb": 1000.0}]
    rows += [{"t_s": 10.0 * (i + 1), "phase": "load", "rss_mb": r} for i, r in enumerate(rss)]
    return [*rows, {"t_s": 10.0 * (len(rss) + 1), "phase": "idle", "rss_mb": 900.0}]


def test_growth_counts_between_one_minute_medians_after_settling_and_at_the_end():
    # Samples every 10 s from 10 s; settled at 60 s. The minute from 60 s (60-110 s) has the
    # median 1,500 MB, the last minute (130-180 s) 1,530 MB: +2%, not counted from the fresh
    # 1,000 MB nor to the idle sample.
    rss = [1200, 1300, 1400, 1400, 1500, 1500, 1500, 1600, 1500, 1500]
    rss += [1500, 1520, 1530, 1530, 1530, 1540, 1540, 1400]
    v = soak.verdict(_samples(rss), settle_s=60, errors=0, window_s=60)
    assert (v["settled_at_s"], v["rss_settled_mb"], v["rss_end_mb"]) == (60, 1500, 1530)
    assert (v["rss_settled_sample_mb"], v["rss_end_sample_mb"], v["rss_max_mb"]) == (
        1500,
        1400,
        1600,
    )
    assert v["growth_after_settle_pct"] == 2.0 and not v["goal_met"]
    assert v["rss_idle_after_mb"] == 900


def test_idle_is_the_last_idle_sample_against_the_fresh_server():
    # Fresh 1,000 MB; the first idle sample (1,120) is before the idle trims; the last counts,
    # not the lowest.
    rows = _samples([1400] * 8)
    rows += [{"t_s": rows[-1]["t_s"] + 10, "phase": "idle", "rss_mb": r} for r in (1040, 1049)]
    rows[-3]["rss_mb"] = 1120
    v = soak.verdict(rows, settle_s=10, errors=0)
    assert (v["rss_idle_after_mb"], v["idle_over_start_pct"]) == (1049, 4.9)
    assert v["idle_goal_met"]
    rows[-1]["rss_mb"] = 1051
    assert not soak.verdict(rows, settle_s=10, errors=0)["idle_goal_met"]


def test_a_single_sample_in_a_trims_dip_or_on_a_peak_does_not_decide():
    """The last soak's 5-minute sample fell in the dip after a session's delete (1,380 MB among
    ~1,400s); with a peak at the end, single samples said +7%, the medians say flat."""
    flat = [1400, 1405, 1398, 1402, 1400, 1401]
    rss = [1300] * 5 + [1270] + flat[1:] + flat * 3 + flat[:-1] + [1500]
    v = soak.verdict(_samples(rss), settle_s=60, errors=0, window_s=60)
    assert v["rss_settled_sample_mb"] == 1270 and v["rss_end_sample_mb"] == 1500
    assert abs(v["growth_after_settle_pct"]) < 0.5 and v["goal_met"]


def test_the_default_window_spans_several_session_loops_and_reads_the_level():
    """A float32 soak's session loop (~80 s) swings RSS from ~1,500 MB to ~1,950 MB; a
    one-minute window says which phase it caught (here +30% with the server flat), the
    default five-minute one reads the level."""
    loop = [1500] * 6 + [1950] * 2  # 80 s: 20 s of it at the session's peak
    rss = (loop * 25)[:174]  # 29 minutes of 10 s samples
    rss[30:36] = [1500] * 6  # the first minute after settling: in the low phase
    rss[-6:] = [1950] * 6  # the last: on the peak
    one = soak.verdict(_samples(rss), settle_s=300, errors=0, window_s=60)
    five = soak.verdict(_samples(rss), settle_s=300, errors=0)
    assert one["growth_after_settle_pct"] == 30.0 and not one["goal_met"]
    assert five["median_window_s"] == 300 and abs(five["growth_after_settle_pct"]) < 2
    assert five["goal_met"]


def test_a_run_shorter_than_the_settling_takes_its_last_sample():
    v = soak.verdict(_samples([1200, 1300]), settle_s=300, errors=0, window_s=60)
    assert (v["settled_at_s"], v["rss_settled_mb"], v["rss_end_mb"]) == (20, 1300, 1300)


def test_the_goal_needs_no_errors_too():
    flat = _samples([1500, 1500, 1510])
    assert soak.verdict(flat, settle_s=10, errors=0)["goal_met"]
    assert not soak.verdict(flat, settle_s=10, errors=1)["goal_met"]


def test_the_rss_sampler_stops_and_joins():
    sampler = RssSampler(os.getpid(), every=0.01)
    sampler.start()
    sampler.stop()
    sampler.join(timeout=10)  # its stop event once shadowed Thread._stop: join raised
    assert not sampler.is_alive()


def test_plot_without_matplotlib_is_one_line_before_the_run(monkeypatch, capsys, tmp_path):
    """--plot with matplotlib missing stops at the arguments, naming the extra, before any
    server starts (the run used to end in a traceback after half an hour)."""
    import importlib.util

    import pytest

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    started = []
    monkeypatch.setattr(soak, "start_server", lambda *a: started.append(a))
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--plot", str(tmp_path / "soak.png"), "--minutes", "0.01"])
    assert exit_.value.code == 2
    assert "--plot needs matplotlib: pip install -e '.[bench]'" in capsys.readouterr().err
    assert not started


def _census_module():
    import importlib.util
    from pathlib import Path

    path = Path(soak.__file__).parent / "census" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("soak_census", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # CDLM_SOAK_CENSUS unset here: no thread starts
    return module


class _Fit:
    def __init__(self, torch):
        self.keys = torch.zeros(2, 3, 4096, 64)  # 6 MB


def test_the_census_counts_tensors_by_storage_and_names_a_new_ones_holder():
    """What the first census saw is the baseline; a storage that came after is 'new', the
    largest ones with chains of who holds them (an attribute, a dict's key, ...)."""
    import torch

    census = _census_module()
    weights = torch.zeros(256, 1024)  # 1 MB, there before the baseline
    views = [weights[:10], weights[1:].t()]  # the same storage: counted once, as the whole
    first, baseline = census.census(None)
    assert first["groups"]["[256, 1024] float32 cpu"] == [1, 1.0]
    assert "[2, 3, 4096, 64] float32 cpu" not in first["groups"]
    assert "[10, 1024] float32 cpu" not in first["groups"]
    assert "[1024, 255] float32 cpu" not in first["groups"]
    held = {"last_piece": _Fit(torch)}
    later, _ = census.census(baseline)
    assert later["groups"]["[2, 3, 4096, 64] float32 cpu"] == [1, 6.0]
    assert later["groups"]["[256, 1024] float32 cpu"] == [1, 1.0]
    top = later["new_top"][0]
    assert (top["tensor"], top["mb"]) == ("[2, 3, 4096, 64] float32", 6.0)
    assert top["held_by"][0].startswith(f"{__name__}._Fit.keys <- builtins.dict['last_piece']")
    assert later["new_mb"] < 7 and later["heap_in_use_mb"] > 0 and later["vmrss_mb"] > 0
    sizes = [mb for _, mb in later["objects"].values()]
    assert len(sizes) == 25 and sizes == sorted(sizes, reverse=True)
    # Python's objects by type (many small ones hold memory no tensor count shows), the
    # largest `top` types by their own allocations, each [count, MB].
    crumbs = [[0] * 1000 for _ in range(300)]  # 300 lists of ~8 KB: ~2.3 MB
    ranked = census._objects_by_type([*crumbs, *[_Fit.__init__] * 5], top=1)
    assert list(ranked) == ["builtins.list"] and ranked["builtins.list"][0] == 300
    assert 2.2 < ranked["builtins.list"][1] < 2.5
    assert views and held


def _census_of(tmp_path, body: str) -> list[dict]:
    """Runs `body` in a process started with the census's environment (a census every 0.2 s),
    until the census file holds `until` (the body's last line names it); the census's rows."""
    out = tmp_path / "census.jsonl"
    env = soak.census_env(argparse.Namespace(census=out))
    assert env is not None
    env["CDLM_SOAK_CENSUS_EVERY"] = "0.2"
    script = body + (
        "path = os.environ['CDLM_SOAK_CENSUS']\n"
        "def seen(): return os.path.exists(path) and until in open(path).read()\n"
        "deadline = time.monotonic() + 60\n"
        "while not seen() and time.monotonic() < deadline: time.sleep(0.05)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_census_runs_inside_a_process_started_with_its_environment(tmp_path):
    """`--census`: the server's environment imports census/sitecustomize.py at start-up (it
    imports nothing of cdlm_serve, so an old checkout's server gets it too), and its thread
    appends a line a period."""
    rows = _census_of(
        tmp_path,
        "import os, time, torch\nheld = torch.zeros(256, 1024)\nuntil = '[256, 1024]'\n",
    )
    assert any(r["groups"].get("[256, 1024] float32 cpu") == [1, 1.0] for r in rows)
    assert all(r["uptime_s"] >= 0 and "error" not in r for r in rows)


def test_sigusr2_starts_a_trace_and_the_census_names_the_line_that_allocated_since(tmp_path):
    """The census's tracemalloc (issue 59's idle): started by SIGUSR2 once the server is up,
    each census lists the lines whose Python allocations grew since; what was allocated before
    the signal is not listed."""
    rows = _census_of(
        tmp_path,
        "import os, signal, time, torch  # a server has torch imported\n"
        "before = [bytes(1000) + bytes([i % 256]) for i in range(4000)]  # 4 MB, untraced\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "time.sleep(0.1)\n"
        "kept = [bytes(1000) + bytes([i % 256]) for i in range(3000)]  # 3 MB: the holder\n"
        "until = '<string>:5'\n",
    )
    traced = [r["traced_new"] for r in rows if "traced_new" in r]
    assert traced, "no census after the signal listed a trace"
    top = traced[-1]["top"][0]
    assert top["at"][0] == "<string>:5" and 2.5 < top["mb"] < 3.5
    assert not any(t["at"][0] == "<string>:2" for r in traced for t in r["top"])
