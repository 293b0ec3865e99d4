"""deploy/'s monitoring stack against the real tools: promtool checks and unit-tests the alert
rules, and a real Prometheus, scraping a server that has served AR completions (streamed and
not), a diffusion request, a session compaction and some errors, answers every query of every
Grafana panel and every alert rule with data (a query naming a metric we do not export has none).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

import tiny_models
from conftest import running_prometheus, running_server
from test_ops import _tool

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "cdlm-serve.json"
COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*([0-9.eE+-]+)\s*$")


def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    promtool = _tool("promtool")
    subprocess.run([promtool, "check", "rules", str(RULES)], check=True, capture_output=True)
    tests = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # The compose file's Prometheus config, with its rule file where this checkout has it.
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_alert_is_unit_tested():
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((RULES.parent / "alerts_test.yml").read_text())["tests"]
    fired = {
        t["alertname"]
        for test in tests
        for t in test.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert alerts and alerts == fired


def _queries() -> dict[str, str]:
    """Every PromQL expression deploy/ ships: dashboard targets (Grafana's variables filled
    in), recording rules, and alerts (their threshold comparison made `bool`, so a healthy
    server still answers with 0s rather than nothing)."""
    out = {}
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            out[f"panel {panel['title']!r} {target['refId']}"] = expr
    for variable in dashboard["templating"]["list"]:
        metric = re.fullmatch(r"label_values\((.+), \w+\)", variable["definition"])
        assert metric, variable["definition"]
        out[f"variable {variable['name']}"] = metric.group(1)
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                out[f"record {rule['record']}"] = rule["record"]
                continue
            expr = COMPARISON.sub(r"\1 bool \2", rule["expr"].strip())
            assert " bool " in expr, rule["alert"]
            out[f"alert {rule['alert']}"] = expr
    return out


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory, tiny_llama_dir):
    llada = tmp_path_factory.mktemp("llada")
    tiny_models.llada_tiny(llada)
    with running_server(
        "--model", f"tiny={tiny_llama_dir}", "--model", f"dlm={llada}", "--device", "cpu"
    ) as url:
        post = lambda path, body: httpx.post(f"{url}{path}", json=body, timeout=120)  # noqa: E731
        for _ in range(3):
            plain = {"model": "tiny", "prompt": "hi", "max_tokens": 8}
            assert post("/v1/completions", plain).status_code == 200
        stream = {"model": "tiny", "prompt": "a", "max_tokens": 8, "stream": True}
        assert post("/v1/completions", stream).status_code == 200
        dlm = {"model": "dlm", "prompt": "x", "max_tokens": 16, "block_size": 8}
        assert post("/v1/completions", dlm).status_code == 200
        context = "The quick brown fox jumps over the lazy dog. " * 6
        session = {"model": "tiny", "id": "s", "prompt": context}
        assert post("/v1/sessions", session).status_code == 201
        assert post("/v1/sessions/s/compact", {"ratio": 2}).status_code == 200
        assert post("/v1/completions", {"model": "nope", "prompt": "a"}).status_code == 404
        yield url


def test_prometheus_answers_every_dashboard_and_alert_query(busy_server, tmp_path):
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "cdlm-serve",
                "static_configs": [{"targets": [busy_server.removeprefix("http://")]}],
            }
        ],
    }
    pending = _queries()
    errors: dict[str, str] = {}
    with running_prometheus(_tool("prometheus"), yaml.safe_dump(config), tmp_path) as api:
        deadline = time.monotonic() + 90
        while pending and time.monotonic() < deadline:
            for name, expr in list(pending.items()):
                try:
                    resp = httpx.get(api, params={"query": expr}, timeout=5)
                except httpx.HTTPError:
                    break  # Prometheus still starting
                if resp.status_code == 503:
                    break  # listening, but its storage is not ready yet
                answer = resp.json()
                if answer.get("status") != "success":
                    errors[name] = f"{resp.status_code}: {answer.get('error', '?')}"
                else:
                    assert resp.status_code == 200, (name, resp.status_code)
                    if answer["data"]["result"]:
                        del pending[name]
            time.sleep(1)
    assert not errors, errors
    assert not pending, f"no data for: {pending}"


def test_compose_mounts_files_that_exist_and_wires_the_stack():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"cdlm-serve", "redis", "prometheus", "grafana"} <= set(services)
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
    gpu = services["cdlm-serve"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert "gpu" in gpu["capabilities"]
    env = services["cdlm-serve"]["environment"]
    assert env["CDLM_SERVE_SESSIONS_REDIS"].startswith("redis://redis:")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["cdlm-serve:8000"]
    # The dashboard's datasource is the provisioned one.
    source = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {source["uid"]}
