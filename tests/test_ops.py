"""Operations: a real Prometheus scrapes us; schemathesis fuzzes the OpenAPI surface."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import running_prometheus, running_server

REQUIRED = os.environ.get("CDLM_REQUIRE_OPS_TOOLS") == "1"  # .ci/run installs them


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{name} is not installed (.ci/run installs it)")
        pytest.skip(f"{name} is not installed; run .ci/run or install it")
    return path


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    with running_server(
        "--model",
        f"tiny={tiny_llama_dir}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "96",
    ) as url:
        yield url


def test_prometheus_scrapes_our_series(base, tmp_path):
    target = base.removeprefix("http://")
    config = (
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: cdlm\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    with running_prometheus(_tool("prometheus"), config, tmp_path) as api:
        for _ in range(3):
            r = httpx.post(
                f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5}
            )
            assert r.status_code == 200
        wanted = {
            "up": 'up{job="cdlm"}',
            "success": 'sum(cdlm_serve:request_success_total{model_name="tiny"})',
            "ttft": 'cdlm_serve:time_to_first_token_seconds_count{model_name="tiny"}',
            "running": 'cdlm_serve:num_requests_running{model_name="tiny"}',
            "kv": 'cdlm_serve:kv_cache_usage_perc{model_name="tiny"}',
        }
        values: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(values) < len(wanted):
            for key, query in wanted.items():
                try:
                    result = httpx.get(api, params={"query": query}, timeout=5).json()
                except httpx.HTTPError:
                    break
                series = result.get("data", {}).get("result", [])
                if series:
                    values[key] = float(series[0]["value"][1])
            time.sleep(0.5)
    assert values.get("up") == 1.0, values
    assert values.get("success", 0) >= 3 and values.get("ttft", 0) >= 3, values
    assert "running" in values and "kv" in values, values


def test_schemathesis_finds_no_server_errors(base, tmp_path):
    """Every route, sessions included, fuzzed; then stateful scenarios that follow the spec's
    links (create a session -> get / compact / continue / delete it). No 5xx, no hang."""
    cli = Path(sys.executable).with_name("schemathesis")
    if not cli.exists():
        cli = Path(_tool("schemathesis"))
    config = tmp_path / "schemathesis.toml"
    config.write_text("[phases.stateful]\nmax-steps = 200\n")
    proc = subprocess.run(
        [
            str(cli),
            "--config-file",
            str(config),
            "run",
            f"{base}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--request-timeout",
            "60",
            "--workers",
            "1",
            "--generation-deterministic",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    covered = re.search(r"API Links:\s+(\d+) covered", proc.stdout)
    assert covered and int(covered.group(1)) >= 3, proc.stdout[-4000:]
