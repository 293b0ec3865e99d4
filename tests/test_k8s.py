"""deploy/k8s/ read as Kubernetes would: every object valid against its API's schema, strictly
(an unknown field is an error, as with `kubectl apply --validate=strict`), the references
between them resolve, the pods run as the design asks (GPU, probes on /health that wait for
model loading, non-root, read-only root), and the metric names given to the monitoring and the
endpoint picker are ones the server exports.

The schemas: Kubernetes' own built-in kinds from `kubernetes-validate`'s copy of the OpenAPI
schemas of one pinned release (`K8S_VERSION`); the Prometheus operator's ServiceMonitor and
PrometheusRule from its CRDs' schemas as `cloudcoil-models-prometheus-operator` carries them
(pydantic models generated from the CRDs, read back as JSON Schema and made strict about
unknown fields, as the API server is with strict field validation). The Gateway API Inference
Extension's InferencePool has no schema obtainable offline (no PyPI or Debian package ships
its CRD): that kind is checked only for the keys these tests read."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cdlm_serve.server.metrics import PREFIX, Metrics

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.37"  # the Kubernetes release whose API the manifests are checked against
# The kinds no schema is obtainable for (see the module's doc): no other may go unchecked.
UNCHECKED = {("inference.networking.k8s.io/v1", "InferencePool")}


def _documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), path
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            out.append((f"{path.name}: {doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def _objects() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in _documents()}


def _strict(schema):
    """A generated schema made strict: an object with declared properties takes no others.
    Go's RE2 patterns are read as Python's (a leading `^(?i)` becomes `(?i)^`)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and pattern.startswith("^(?i)"):
            schema["pattern"] = "(?i)^" + pattern.removeprefix("^(?i)")
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


@functools.cache
def _crd_validators() -> dict[tuple[str, str], jsonschema.Draft202012Validator]:
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    out = {}
    for model in (monitoring.ServiceMonitor, monitoring.PrometheusRule):
        schema = _strict(model.model_json_schema(by_alias=True))
        jsonschema.Draft202012Validator.check_schema(schema)
        key = ("monitoring.coreos.com/v1", model.__name__)
        out[key] = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
    return out


def _schema_errors(doc: dict) -> list[str] | None:
    """What the object's schema says is wrong with it (nothing: []); None for a kind no schema
    is obtainable for."""
    key = (doc["apiVersion"], doc["kind"])
    if key in _crd_validators():
        errors = _crd_validators()[key].iter_errors(doc)
        return [f"{list(e.absolute_path)}: {e.message}" for e in errors]
    try:
        version = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return None
    except kubernetes_validate.ValidationError as e:
        return [f"{list(e.absolute_path)}: {e.message}"]
    assert version == K8S_VERSION  # the pinned release's schemas, not an older one's
    return []


def test_every_object_is_valid_against_its_api_schema():
    errors, unchecked = {}, set()
    for name, doc in _documents():
        found = _schema_errors(doc)
        if found is None:
            unchecked.add((doc["apiVersion"], doc["kind"]))
        elif found:
            errors[name] = found
    assert not errors, errors
    assert unchecked == UNCHECKED


def _container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


# Objects of the manifests with one mistake each (a misspelled field, a wrong type, a value
# out of its pattern, a required field left out), in built-in kinds and in the operator's.
MUTANTS = {
    "misspelled imagePullPolicy": (
        ("Deployment", "cdlm-serve"),
        lambda d: _container(d).update(imagePullPolicyy="IfNotPresent"),
    ),
    "containerPort as a string": (
        ("Deployment", "cdlm-serve"),
        lambda d: _container(d)["ports"][0].update(containerPort="8000"),
    ),
    "misspelled Service field": (
        ("Service", "cdlm-serve"),
        lambda d: d["spec"].update(selectors=d["spec"]["selector"]),
    ),
    "misspelled ServiceMonitor endpoint field": (
        ("ServiceMonitor", "cdlm-serve"),
        lambda d: d["spec"]["endpoints"][0].update(intervall="15s"),
    ),
    "ServiceMonitor interval not a duration": (
        ("ServiceMonitor", "cdlm-serve"),
        lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds"),
    ),
    "PrometheusRule rule without its expr": (
        ("PrometheusRule", "cdlm-serve"),
        lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr"),
    ),
    "misspelled PrometheusRule rule field": (
        ("PrometheusRule", "cdlm-serve"),
        lambda d: d["spec"]["groups"][-1]["rules"][-1].update(annotation={"summary": "x"}),
    ),
}


@pytest.mark.parametrize("what", MUTANTS)
def test_the_schema_check_refuses_a_broken_object(what):
    key, change = MUTANTS[what]
    doc = copy.deepcopy(_objects()[key])
    assert _schema_errors(doc) == []
    change(doc)
    assert _schema_errors(doc), what


def _exported() -> set[str]:
    metrics = Metrics()
    metrics.add_gauges(lambda: {"m": (0, 0, 0.0, 0)})
    metrics.add_session_gauges(lambda: (0, 0, 0, 0), lambda: {"disk": 0, "tier": 0})
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
