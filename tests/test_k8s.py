"""deploy/k8s/ read as Kubernetes would: every object well formed, the references between them
resolve, the pods run as the design asks (GPU, probes on /health that wait for model loading,
non-root, read-only root), and the metric names given to the monitoring and the endpoint
picker are ones the server exports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from server.metrics import PREFIX, Metrics

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"


def _objects() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _exported() -> set[str]:
    metrics = Metrics()
    metrics.add_gauges(lambda: {"m": (0, 0, 0.0)})
    metrics.add_session_gauges(lambda: (0, 0, 0, 0))
    names = re.findall(r"^# TYPE (\S+)", metrics.render().decode(), flags=re.M)
    return set(names)


def test_the_server_pods_are_set_up_as_a_gpu_service():
    objs = _objects()
    deployment = objs[("Deployment", "cdlm-serve")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"]
    # Everything the server writes is a volume: the model cache, the sessions, scratch.
    env = objs[("ConfigMap", "cdlm-serve")]["data"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {env["CDLM_SERVE_HOME"], env["CDLM_SERVE_SESSIONS_DIR"], "/tmp"} <= mounts
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert all(("PersistentVolumeClaim", c) in objs for c in claims)
    assert ("ConfigMap", container["envFrom"][0]["configMapRef"]["name"]) in objs
    # Sessions are shared through the Redis the manifests run.
    redis = env["CDLM_SERVE_SESSIONS_REDIS"]
    host = redis.removeprefix("redis://").split(":")[0]
    assert ("Service", host) in objs and ("Deployment", host) in objs
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget", "ServiceMonitor", "InferencePool"):
        obj = objs[(kind, "cdlm-serve")]
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), kind
    service_ports = {p["name"] for p in objs[("Service", "cdlm-serve")]["spec"]["ports"]}
    monitor = objs[("ServiceMonitor", "cdlm-serve")]["spec"]["endpoints"][0]
    assert monitor["port"] in service_ports and monitor["path"] == "/metrics"


def test_metric_names_given_to_the_endpoint_picker_are_exported():
    objs = _objects()
    exported = _exported()
    args = objs[("Deployment", "cdlm-serve-epp")]["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.removeprefix("--").split("=", 1) for a in args["args"])
    for flag in ("total-queued-requests-metric", "total-running-requests-metric"):
        assert flags[flag] in exported, flag
    assert flags["kv-cache-usage-percentage-metric"] in exported
    assert all(name.startswith(PREFIX) for name in (flags["total-queued-requests-metric"],))
    pool = objs[("InferencePool", "cdlm-serve")]["spec"]
    assert pool["endpointPickerRef"]["name"] == "cdlm-serve-epp"
    assert ("Service", "cdlm-serve-epp") in objs


def test_the_operator_rules_are_the_tested_alert_rules():
    rules = yaml.safe_load((K8S.parent / "prometheus" / "alerts.yml").read_text())
    assert _objects()[("PrometheusRule", "cdlm-serve")]["spec"] == rules
