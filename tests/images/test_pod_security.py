"""Every pod Argosy ships (the operator's Deployment, the runtime pods the operator builds, the
gateway Deployment of docs/deploy.md) is admitted under Pod Security `restricted` and can write
its temporary files although its root filesystem is read-only.

The `restricted` checks are the ones of Kubernetes' Pod Security Standards that these pods could
trip (https://kubernetes.io/docs/concepts/security/pod-security-standards/): a namespace (or a
cluster default) enforcing `restricted` refuses a pod that fails one, and the ReplicaSet then
creates no pod at all, only FailedCreate events.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from argosy_operator.builders import build_deployment
from argosy_operator.spec import normalize_spec

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "deploy.md"
SAMPLES = REPO / "manifests" / "samples"

# Volume types `restricted` allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What Pod Security `restricted` refuses in a pod spec (empty: admitted)."""
    out: list[str] = []
    pod_ctx = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key} is true")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds)} is not allowed")
    if pod_ctx.get("runAsUser") == 0:
        out.append("pod runAsUser is 0")
    containers = pod.get("initContainers", []) + pod["containers"]
    for c in containers:
        ctx = c.get("securityContext") or {}
        name = c["name"]
        if ctx.get("privileged"):
            out.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot", False)):
            out.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if ctx.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser is 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost "
                       "(pod or container)")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


def tmp_violations(pod: dict[str, Any]) -> list[str]:
    """Containers with a read-only root filesystem and no writable /tmp: Python's tempfile
    (the gateway spools `POST /v1/files` uploads with it; g++ and Triton write there too) then
    finds no usable directory and the request fails with a 500."""
    writable = {v["name"] for v in pod.get("volumes", [])
                if "emptyDir" in v or "ephemeral" in v}
    out = []
    for c in pod.get("initContainers", []) + pod["containers"]:
        if not (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            continue
        if not any(m["mountPath"] == "/tmp" and m["name"] in writable
                   and not m.get("readOnly") for m in c.get("volumeMounts", [])):
            out.append(f"{c['name']}: read-only root filesystem without a writable /tmp")
    return out


def doc_gateway_pod() -> dict[str, Any]:
    bodies = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    (deployment,) = [d for body in bodies for d in yaml.safe_load_all(body)
                     if isinstance(d, dict) and d.get("kind") == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def operator_pod() -> dict[str, Any]:
    deployment = yaml.safe_load((REPO / "manifests" / "operator" / "deployment.yaml").read_text())
    return deployment["spec"]["template"]["spec"]


def runtime_pod(spec_patch: dict[str, Any] | None, sample: str) -> dict[str, Any]:
    obj = yaml.safe_load((SAMPLES / sample).read_text())
    obj["metadata"].update(namespace="default", uid="uid-1")
    spec = obj["spec"]
    if spec_patch:
        spec["model"] = {k: v for k, v in spec["model"].items()
                         if k not in ("source", "path", "credentialsSecret")}
        spec["model"].update(spec_patch)
    return build_deployment(obj, normalize_spec(spec), replicas=1)["spec"]["template"]["spec"]


PODS = {
    "gateway (docs/deploy.md)": doc_gateway_pod,
    "operator (manifests/operator)": operator_pod,
    "runtime cpu, baked-in model": lambda: runtime_pod(None, "cpu-smollm2.yaml"),
    "runtime gpu, hf:// download": lambda: runtime_pod(None, "gpu-llama-3.1-8b-int4.yaml"),
    "runtime, s3:// download": lambda: runtime_pod(
        {"source": "s3://models-bucket/llama/", "credentialsSecret": "s3"},
        "gpu-llama-3.1-8b-int4.yaml"),
    "runtime, pvc:// model": lambda: runtime_pod({"source": "pvc://models/llama"},
                                                 "gpu-llama-3.1-8b-int4.yaml"),
}


@pytest.mark.parametrize("build", PODS.values(), ids=PODS.keys())
def test_pod_is_admitted_under_pod_security_restricted(build: Any) -> None:
    assert restricted_violations(build()) == []


@pytest.mark.parametrize("build", PODS.values(), ids=PODS.keys())
def test_read_only_root_filesystem_comes_with_a_writable_tmp(build: Any) -> None:
    assert tmp_violations(build()) == []


def test_the_checks_catch_what_they_look_for() -> None:
    pod = {"securityContext": {"runAsNonRoot": True},
           "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
           "containers": [{"name": "c", "securityContext": {"readOnlyRootFilesystem": True}}]}
    found = " ".join(restricted_violations(pod))
    for needle in ("hostPath", "allowPrivilegeEscalation", "drop ALL", "seccompProfile"):
        assert needle in found
    assert tmp_violations(pod) == ["c: read-only root filesystem without a writable /tmp"]
