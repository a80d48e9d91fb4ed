"""The real kopf operator against the emulated API server (see kube_emulator.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import NS, Api, eventually, settle

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
SVC_PATH = f"/api/v1/namespaces/{NS}/services"
PDB_PATH = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"
SM_PATH = f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/servicemonitors"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
EVENT_PATH = f"/api/v1/namespaces/{NS}/events"


def llmd(name: str = "chat", **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "smollm2", "path": "smollm2-135m"}, "replicas": 2,
            "resources": {"cpu": "2", "memory": "4Gi"}}
    body.update(spec)
    return {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": body}


def writes(kube: Any, path_part: str = "") -> list[Any]:
    """The write requests (POST/PATCH/DELETE) the API saw, optionally under one path."""
    return [r for r in list(kube) if r.method in ("POST", "PATCH", "DELETE", "PUT")
            and path_part in str(r.url)]


async def test_create_makes_owned_children_and_status(kube: Any, api: Api, run_operator: Any
                                                      ) -> None:
    with run_operator():
        created = await api.call("POST", LLMD_PATH, llmd(), "application/json")
        uid = created["metadata"]["uid"]
        dep = await eventually(lambda: api.get_or_none(f"{DEP_PATH}/chat"), what="Deployment")
        svc = await eventually(lambda: api.get_or_none(f"{SVC_PATH}/chat"), what="Service")
        pdb = await eventually(lambda: api.get_or_none(f"{PDB_PATH}/chat"), what="PDB")
        sm = await eventually(lambda: api.get_or_none(f"{SM_PATH}/chat"), what="ServiceMonitor")

        async def status() -> Any:
            obj = await api.get_or_none(f"{LLMD_PATH}/chat")
            return obj if obj.get("status", {}).get("observedGeneration") == 1 else None

        obj = await eventually(status, what="status")
        await settle(kube)

    for child in (dep, svc, pdb, sm):
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                         "name": "chat", "uid": uid, "controller": True}]
    assert dep["spec"]["replicas"] == 2
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["serve", "--model", "smollm2-135m"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    status = obj["status"]
    assert status["selector"] == "argosy.dev/llmdeployment=chat"
    assert status["endpoint"] == f"http://chat.{NS}.svc:8000/v1"
    assert (status["replicas"], status["readyReplicas"]) == (0, 0)
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "NoReplicasReady"
    assert conds["Progressing"]["status"] == "True"
    assert conds["Degraded"]["status"] == "False"
    # Kopf's bookkeeping stays out of status; one create per child, no duplicates.
    assert set(status) <= {"observedGeneration", "replicas", "readyReplicas", "updatedReplicas",
                           "selector", "endpoint", "model", "conditions"}
    assert len([r for r in writes(kube, DEP_PATH) if r.method == "POST"]) == 1
    reasons = [r.data["reason"] for r in writes(kube, EVENT_PATH)]
    assert "Created" in reasons
    messages = [r.data["message"] for r in writes(kube, EVENT_PATH)]
    assert "created Deployment chat" in messages and "created Service chat" in messages
