"""manifests/operator renders with kustomize, validates against Kubernetes' schemas, and its
ClusterRole grants exactly the calls the operator makes."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml
from argosy_operator.builders import (
    build_deployment,
    build_pdb,
    build_service,
    build_servicemonitor,
)
from argosy_operator.constants import LORA_FILE_KEY
from argosy_operator.spec import normalize_spec
from crd_schema import ROOT, validate
from operator_helpers import NS, Api, eventually, granted_calls, operator_calls, settle

# The oldest Kubernetes the manifests target (the preStop `sleep` action is beta in 1.30).
K8S_VERSION = "1.30.0"
KUBECTL = shutil.which("kubectl")


def render() -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = subprocess.run([KUBECTL, "kustomize", str(ROOT / "manifests" / "operator")],
                         capture_output=True, text=True, check=True, timeout=60)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_renders_the_operator_bundle() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in render())
    assert kinds == [("ClusterRole", "argosy-operator"), ("ClusterRoleBinding", "argosy-operator"),
                     ("CustomResourceDefinition", "llmdeployments.argosy.dev"),
                     ("Deployment", "argosy-operator"), ("Namespace", "argosy-system"),
                     ("ServiceAccount", "argosy-operator")]


def test_rendered_objects_validate_against_kubernetes_schemas() -> None:
    for doc in render():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_operator_deployment_runs_kopf_with_a_liveness_probe() -> None:
    (dep,) = [d for d in render() if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/argosy-project/argosy-operator:0.1.0"
    cmd = container["command"]
    assert cmd[:2] == ["kopf", "run"] and cmd[-2:] == ["-m", "argosy_operator.handlers"]
    liveness = next(a for a in cmd if a.startswith("--liveness="))
    port = int(liveness.split(":")[-1].split("/")[0])
    probe = container["livenessProbe"]["httpGet"]
    assert liveness.endswith(probe["path"])
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]] == port
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "argosy-operator"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("sample", sorted((ROOT / "manifests" / "samples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_built_children_validate_against_kubernetes_schemas(sample: Any) -> None:
    obj, errors = validate(yaml.safe_load(sample.read_text()))
    assert errors == []
    obj["metadata"].update(namespace="default", uid="0b3c8a4e-0000-4000-8000-000000000001")
    spec = normalize_spec(obj["spec"])
    children = [build_deployment(obj, spec, replicas=2), build_service(obj, spec),
                build_pdb(obj, spec)]
    for child in filter(None, children):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    assert build_servicemonitor(obj, spec) is not None  # a CRD: no schema in the bundle
    # The container's args are ones `argosy serve` takes (extraArgs included): parsed by the
    # runtime's own parser, which exits on an unknown flag or a bad value.
    from argosy_runtime.cli.main import build_parser

    build_parser().parse_args(children[0]["spec"]["template"]["spec"]["containers"][0]["args"])


# --- RBAC ------------------------------------------------------------------------------------

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"


def _rbac_grants() -> set[tuple[str, str, str]]:
    (role,) = [d for d in render() if d["kind"] == "ClusterRole"]
    return granted_calls(role)


# Calls only the autoscaler makes; test_timer_kmock.py checks that they are granted.
AUTOSCALER_ONLY = {("", "pods", "patch")}  # pod-deletion-cost before a scale-down


async def test_cluster_role_grants_exactly_the_calls_made(kube: Any, api: Api,
                                                          run_operator: Any) -> None:
    """A full cycle: create (all five children), pod and Deployment events, a spec change that
    patches the ServiceMonitor and the LoRA ConfigMap, one that patches the Deployment and
    Service and deletes the PDB, ServiceMonitor and ConfigMap, deletion. (The autoscaler's
    calls are the timer tests'.)"""
    body = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "chat", "namespace": NS},
            "spec": {"model": {"name": "m", "path": "smollm2-135m"}, "replicas": 2,
                     "runtime": {"loraAdapters": [{"name": "sql", "path": "/l/sql"}]}}}
    with run_operator():
        await api.call("POST", LLMD_PATH, body, "application/json")
        await eventually(lambda: api.get_or_none(
            f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/servicemonitors/chat"))
        await api.call("POST", f"/api/v1/namespaces/{NS}/pods", {
            "metadata": {"name": "chat-1", "labels": {
                "argosy.dev/llmdeployment": "chat",
                "app.kubernetes.io/managed-by": "argosy-operator"}}}, "application/json")
        await api.call("PATCH", f"/api/v1/namespaces/{NS}/pods/chat-1/status", {"status": {
            "containerStatuses": [{"name": "runtime", "state": {"waiting": {
                "reason": "ErrImagePull"}}}]}})
        # Someone edits the PDB by hand; the next reconcile (an interval change that patches
        # the ServiceMonitor) puts the operator's fields back.
        pdb_path = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/chat"
        await api.call("PATCH", pdb_path, {"spec": {"maxUnavailable": 0}})
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "monitoring": {"interval": "30s"}, "runtime": {"loraAdapters": []}}})

        sm_path = f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/servicemonitors/chat"
        cm_path = f"/api/v1/namespaces/{NS}/configmaps/chat"

        async def first_change_applied() -> bool:
            # All three, not just the PDB: its drift handler may revert it before the spec
            # change is reconciled, and kopf would then fold both spec changes into one.
            pdb = await api.get_or_none(pdb_path)
            sm = await api.get_or_none(sm_path)
            cm = await api.get_or_none(cm_path)
            return pdb["spec"]["maxUnavailable"] == 1 \
                and sm["spec"]["endpoints"][0]["interval"] == "30s" \
                and json.loads(cm["data"][LORA_FILE_KEY]) == {}

        await eventually(first_change_applied, what="PDB drift corrected, first change applied")
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "replicas": 1, "service": {"port": 80}, "monitoring": {"serviceMonitor": False},
            "runtime": {"loraAdapters": None}}})
        async def pdb_and_configmap_gone() -> bool:
            return await api.get_or_none(pdb_path) is None \
                and await api.get_or_none(cm_path) is None

        await eventually(pdb_and_configmap_gone, what="PDB and ConfigMap deleted")
        await settle(kube)
        await api.call("DELETE", f"{LLMD_PATH}/chat")
        await settle(kube)
    assert operator_calls(kube) | AUTOSCALER_ONLY == _rbac_grants()
