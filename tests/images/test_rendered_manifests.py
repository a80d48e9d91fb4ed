"""Every manifest users apply renders and validates against Kubernetes' schemas.

`kubectl kustomize` (no cluster needed) renders each kustomization under manifests/; every
rendered object, the CRD and the samples are validated with kubernetes-validate (strict: unknown
fields are errors) at the kind suite's Kubernetes version and at the newest one the package
knows, and LLMDeployments against the CRD's own openAPIV3Schema. The operator Deployment must
run the operator image the way the image expects.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
CRD = REPO / "crds" / "llmdeployments.argosy.dev.yaml"
KIND_CONFIG = REPO / "e2e" / "kind" / "kind-config.yaml"
OPERATOR_IMAGE = "ghcr.io/argosy-project/argosy-operator:0.1.0"


def k8s_versions() -> list[str]:
    tag = yaml.safe_load(KIND_CONFIG.read_text())["nodes"][0]["image"].split(":v", 1)[1]
    major, minor = tag.split(".")[:2]
    return sorted({f"{major}.{minor}", ".".join(latest_version().split(".")[:2])})


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in MANIFESTS.rglob("kustomization.y*ml"))


@cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not on PATH (it renders kustomizations without a cluster)")
    proc = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"kubectl kustomize {directory}: {proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@lru_cache(maxsize=1)
def llmd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    return version["schema"]["openAPIV3Schema"]


# The Prometheus Operator's kinds that manifests/monitoring holds: the fields of its CRDs'
# schemas that these manifests use, strict (a misspelt field is an error, as it would be for a
# server-side apply against the CRD).
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
             r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECT_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRING_MAP,
    "annotations": _STRING_MAP}, "additionalProperties": False}
PROMETHEUS_OPERATOR_SCHEMAS: dict[str, dict[str, Any]] = {
    "PrometheusRule": {"type": "object", "required": ["spec"], "properties": {
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False,
                 "properties": {"groups": {"type": "array", "items": {
                     "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "minLength": 1},
                                    "interval": _DURATION,
                                    "rules": {"type": "array", "items": {
                                        "type": "object", "required": ["expr"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "alert": {"type": "string"},
                                            "record": {"type": "string"},
                                            "expr": {"type": ["string", "integer"]},
                                            "for": _DURATION, "keep_firing_for": _DURATION,
                                            "labels": _STRING_MAP,
                                            "annotations": _STRING_MAP}}}}}}}}}},
    "PodMonitor": {"type": "object", "required": ["spec"], "properties": {
        "spec": {"type": "object", "required": ["selector"], "additionalProperties": False,
                 "properties": {
                     "jobLabel": {"type": "string"},
                     "namespaceSelector": {"type": "object", "additionalProperties": False,
                                           "properties": {"any": {"type": "boolean"},
                                                          "matchNames": {"type": "array"}}},
                     "selector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchLabels": _STRING_MAP,
                                                 "matchExpressions": {"type": "array"}}},
                     "podMetricsEndpoints": {"type": "array", "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                        "interval": _DURATION, "scrapeTimeout": _DURATION,
                                        "scheme": {"enum": ["http", "https"]},
                                        "honorLabels": {"type": "boolean"}}}}}}}},
}


def validate(obj: dict[str, Any], where: str) -> None:
    """Kubernetes' schema for built-in kinds, the CRD's for LLMDeployment, the Prometheus
    Operator's (the part used) for its kinds; unknown kinds fail."""
    name = f"{where}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("apiVersion") == "monitoring.coreos.com/v1":
        assert obj["kind"] in PROMETHEUS_OPERATOR_SCHEMAS, name
        schema = {**PROMETHEUS_OPERATOR_SCHEMAS[obj["kind"]]}
        schema["properties"] = {**schema["properties"], "apiVersion": {"type": "string"},
                                "kind": {"type": "string"}, "metadata": _OBJECT_META}
        schema["additionalProperties"] = False
        try:
            jsonschema.Draft7Validator(schema).validate(obj)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{name} invalid for the Prometheus Operator's CRD: {exc.message} at "
                        f"{list(exc.path)}")
        return
    if obj.get("apiVersion", "").startswith("argosy.dev/"):
        assert obj["kind"] == "LLMDeployment", name
        try:
            jsonschema.Draft4Validator(llmd_schema()).validate(obj)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{name} invalid for the CRD: {exc.message} at {list(exc.path)}")
        return
    for version in k8s_versions():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name} invalid for Kubernetes {version}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{name}: no Kubernetes {version} schema for {obj.get('apiVersion')}")


def test_manifests_have_the_operator_kustomization() -> None:
    if not (MANIFESTS / "operator").exists():
        pytest.skip("manifests/operator not written yet (operator issue)")
    assert MANIFESTS / "operator" in kustomizations()


@pytest.mark.parametrize("directory", kustomizations(), ids=lambda p: str(p.relative_to(REPO)))
def test_kustomization_renders_and_every_object_validates(directory: Path) -> None:
    objects = render(directory)
    assert objects, f"{directory} renders nothing"
    for obj in objects:
        validate(obj, str(directory.relative_to(REPO)))


def test_crd_validates_as_a_custom_resource_definition() -> None:
    if not CRD.exists():
        pytest.skip("CRD not written yet (operator issue)")
    (crd,) = [d for d in yaml.safe_load_all(CRD.read_text()) if d]
    validate(crd, "crds")
    assert crd["metadata"]["name"] == "llmdeployments.argosy.dev"


@pytest.mark.parametrize("sample", sorted((MANIFESTS / "samples").glob("*.y*ml")),
                         ids=lambda p: p.name)
def test_samples_validate(sample: Path) -> None:
    docs = [d for d in yaml.safe_load_all(sample.read_text()) if d]
    assert docs
    for doc in docs:
        validate(doc, f"samples/{sample.name}")
        if doc["kind"] == "LLMDeployment":
            image = (doc["spec"].get("runtime") or {}).get("image")
            assert image is None or image.startswith("ghcr.io/argosy-project/argosy-runtime-")


def test_a_broken_prometheus_rule_is_reported() -> None:
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "x"},
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0",
                                                         "for": "5 minutes"}]}]}}
    with pytest.raises(pytest.fail.Exception):
        validate(rule, "test")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "5m"
    validate(rule, "test")
    rule["spec"]["groups"][0]["rules"][0]["severity"] = "warning"  # belongs under labels
    with pytest.raises(pytest.fail.Exception):
        validate(rule, "test")


def test_a_broken_object_is_reported(tmp_path: Path) -> None:
    """The validation above can fail: a typo'd field and a wrong type are both errors."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replica": 1, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "i",
                                                          "ports": [{"containerPort": "80"}]}]}}}}
    with pytest.raises(pytest.fail.Exception):
        validate(bad, "test")


def operator_deployment() -> dict[str, Any]:
    if not (MANIFESTS / "operator").exists():
        pytest.skip("manifests/operator not written yet (operator issue)")
    deployments = [o for o in render(MANIFESTS / "operator") if o["kind"] == "Deployment"]
    assert len(deployments) == 1
    return deployments[0]


def test_operator_deployment_runs_the_operator_image_as_built() -> None:
    pod = operator_deployment()["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["image"].startswith(OPERATOR_IMAGE)]
    assert container["image"] == OPERATOR_IMAGE
    # A kind-loaded image must not be pulled again.
    assert container.get("imagePullPolicy", "IfNotPresent") != "Always"
    # The image's CMD, or the same command spelled out (so `docker run` behaves like the pod).
    command = container.get("command", []) + container.get("args", [])
    if command:
        from dockerfile_parser import parse

        image_cmd = parse(REPO / "docker" / "operator.Dockerfile").final.last("CMD")
        assert command == image_cmd.exec_form()
    probe = container.get("livenessProbe", {}).get("httpGet", {})
    assert probe.get("path") == "/healthz"
    port = probe.get("port")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert ports.get(port, port) == 8080 or (command and f":{ports.get(port, port)}/" in
                                             " ".join(command))
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    assert security.get("runAsNonRoot") is True
