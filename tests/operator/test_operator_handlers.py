"""The real kopf operator against the emulated API server (see kube_emulator.py)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kube_emulator import SERVICEMONITOR_CRD
from operator_helpers import NS, Api, eventually, settle, wait_for_degraded

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
    # Pods and children are listed and watched through a server-side label selector (a label
    # filter in the handlers alone would stream every Service and ConfigMap of the cluster).
    watched = ("pods", "deployments", "services", "poddisruptionbudgets", "configmaps",
               "servicemonitors")
    child_reads = [r for r in list(kube) if r.method == "GET" and r.resource is not None
                   and r.resource.plural in watched and r.name is None]
    assert {r.resource.plural for r in child_reads} == set(watched)
    assert all(
        r.params.get("labelSelector", "").startswith("app.kubernetes.io/managed-by="
                                                      "argosy-operator,")
        or r.params.get("labelSelector") == "argosy.dev/llmdeployment=chat"
        for r in child_reads), [str(r.url) for r in child_reads]
    reasons = [r.data["reason"] for r in writes(kube, EVENT_PATH)]
    assert "Created" in reasons
    messages = [r.data["message"] for r in writes(kube, EVENT_PATH)]
    assert "created Deployment chat" in messages and "created Service chat" in messages


async def _status(api: Api, name: str = "chat") -> dict[str, Any]:
    obj = await api.get_or_none(f"{LLMD_PATH}/{name}")
    return (obj or {}).get("status", {})


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


async def test_spec_change_patches_deployment_in_place(kube: Any, api: Api, run_operator: Any
                                                      ) -> None:
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        dep = await eventually(lambda: api.get_or_none(f"{DEP_PATH}/chat"), what="Deployment")
        await settle(kube)
        dep_gen = dep["metadata"]["generation"]
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "runtime": {"maxNumSeqs": 64, "env": [{"name": "LOG_LEVEL", "value": "debug"}]},
            "podTemplate": {"labels": {"team": "search"}}}})

        async def rolled() -> Any:
            d = await api.get_or_none(f"{DEP_PATH}/chat")
            return d if d["metadata"]["generation"] > dep_gen else None

        dep2 = await eventually(rolled, what="Deployment patched")
        await eventually(lambda: _observed(api, 2), what="observedGeneration 2")
        await settle(kube)
        # Removing the label again takes it off the pod template (three-way merge).
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"podTemplate": None}})
        await eventually(lambda: _observed(api, 3), what="observedGeneration 3")
        await settle(kube)
        dep3 = await api.get_or_none(f"{DEP_PATH}/chat")

    args = dep2["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64"
    env = dep2["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "LOG_LEVEL", "value": "debug"} in env
    assert dep2["spec"]["template"]["metadata"]["labels"]["team"] == "search"
    assert "team" not in dep3["spec"]["template"]["metadata"]["labels"]
    assert dep3["metadata"]["uid"] == dep["metadata"]["uid"]  # patched, never re-created
    assert len([r for r in writes(kube, DEP_PATH) if r.method == "POST"]) == 1
    assert not [r for r in writes(kube, DEP_PATH) if r.method == "DELETE"]
    # Each spec change is one Deployment patch, and it never touches replicas it already holds.
    dep_patches = [r for r in writes(kube, f"{DEP_PATH}/chat") if r.method == "PATCH"]
    assert len(dep_patches) == 2
    assert all("replicas" not in p.data.get("spec", {}) for p in dep_patches)


async def _observed(api: Api, generation: int, name: str = "chat") -> bool:
    return (await _status(api, name)).get("observedGeneration") == generation


async def _make_pod(api: Api, name: str, **status: Any) -> None:
    """Create a runtime pod (as the ReplicaSet would) and report its status (as the kubelet
    or scheduler would: through the status subresource)."""
    await api.call("POST", POD_PATH, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {
            "argosy.dev/llmdeployment": "chat",
            "app.kubernetes.io/managed-by": "argosy-operator"}},
        "spec": {"containers": [{"name": "runtime", "image": "x"}]}}, "application/json")
    await api.call("PATCH", f"{POD_PATH}/{name}/status", {"status": status})


async def test_child_status_flows_into_conditions(kube: Any, api: Api, run_operator: Any
                                                  ) -> None:
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await eventually(lambda: _observed(api, 1), what="first status")
        # The kubelet reports an image pull failure on one pod ...
        await _make_pod(api, "chat-a", phase="Pending", containerStatuses=[{
            "name": "runtime", "ready": False, "state": {"waiting": {
                "reason": "ImagePullBackOff",
                "message": 'Back-off pulling image "ghcr.io/x/typo:1"'}}}])

        async def degraded(reason: str) -> Any:
            cond = _cond(await _status(api), "Degraded")
            return cond if cond.get("status") == "True" and cond["reason"] == reason else None

        pull = await eventually(lambda: degraded("ImagePullFailure"), what="ImagePullFailure")
        # More status changes while the image still fails: no repeated warning.
        await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
            "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2}})

        async def counted() -> bool:
            return (await _status(api)).get("replicas") == 2

        await eventually(counted, what="replicas 2")
        # ... the scheduler cannot place another one (no free GPU) ...
        await api.call("DELETE", f"{POD_PATH}/chat-a")
        await _make_pod(api, "chat-b", phase="Pending", conditions=[{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
        sched = await eventually(lambda: degraded("Unschedulable"), what="Unschedulable")
        # ... then the Deployment controller reports both replicas ready.
        await api.call("DELETE", f"{POD_PATH}/chat-b")
        await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
            "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
            "availableReplicas": 2}})

        async def ready() -> Any:
            status = await _status(api)
            return status if _cond(status, "Ready").get("status") == "True" else None

        status = await eventually(ready, what="Ready")
        await settle(kube)
        warnings = [r.data for r in writes(kube, EVENT_PATH) if r.data["type"] == "Warning"]

    assert "ghcr.io/x/typo:1" in pull["message"] and "chat-a" in pull["message"]
    assert "Insufficient nvidia.com/gpu" in sched["message"]
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert _cond(status, "Ready")["reason"] == "AllReplicasReady"
    assert _cond(status, "Progressing")["status"] == "False"
    assert _cond(status, "Degraded")["status"] == "False"
    assert [w["reason"] for w in warnings] == ["ImagePullFailure", "Unschedulable"]


async def test_delete_leaves_nothing_behind(kube: Any, api: Api, run_operator: Any) -> None:
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await eventually(lambda: api.get_or_none(f"{SM_PATH}/chat"), what="children")
        await eventually(lambda: _observed(api, 1), what="status")
        await api.call("DELETE", f"{LLMD_PATH}/chat")

        async def gone() -> bool:
            paths = [f"{p}/chat" for p in (LLMD_PATH, DEP_PATH, SVC_PATH, PDB_PATH, SM_PATH)]
            return all([await api.get_or_none(p) is None for p in paths])

        await eventually(gone, what="all objects deleted")
        await settle(kube)
    # Nothing was re-created after the deletion, and no finalizer held the object.
    alive = [key for key, obj in kube.objects.items() if not obj.deleted
             and key[0].plural != "events"]
    assert alive == []
    deletes = [r for r in list(kube) if r.method == "DELETE"]
    assert len(deletes) == 1  # only the user's; the garbage collector did the rest


async def test_event_queued_before_delete_recreates_nothing(kube: Any, api: Api,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """kopf can hand the handler an event it queued before the user's delete (seen under load:
    the children came back after `kubectl delete`). The stale body must apply nothing, also
    when an object of the same name but a new uid exists by then."""
    from argosy_operator import handlers
    from argosy_operator.kube import KubeClient

    stale = await api.call("POST", LLMD_PATH, llmd(), "application/json")
    await api.call("DELETE", f"{LLMD_PATH}/chat")
    client = KubeClient(str(kube.url))
    monkeypatch.setitem(handlers._state, "client", client)
    try:
        log = logging.getLogger("test")
        await handlers.reconcile_llmdeployment(body=stale, meta=stale["metadata"], logger=log)
        await api.call("POST", LLMD_PATH, llmd(), "application/json")  # same name, new uid
        await handlers.reconcile_llmdeployment(body=stale, meta=stale["metadata"], logger=log)
    finally:
        await client.close()
    assert [r for r in writes(kube) if LLMD_PATH not in str(r.url)] == []


async def test_restart_midway_creates_no_duplicates_and_then_stays_quiet(
        kube: Any, api: Api, run_operator: Any) -> None:
    created = await api.call("POST", LLMD_PATH, llmd(), "application/json")
    # A previous operator run created the Deployment, then died before the Service.
    with run_operator():
        await eventually(lambda: api.get_or_none(f"{SVC_PATH}/chat"), what="Service")
        await eventually(lambda: _observed(api, 1), what="status")
        await settle(kube)
    dep = await api.get_or_none(f"{DEP_PATH}/chat")
    await api.call("DELETE", f"{SVC_PATH}/chat")
    await api.call("DELETE", f"{PDB_PATH}/chat")
    await api.call("DELETE", f"{SM_PATH}/chat")
    before = len(list(kube))
    with run_operator():  # resumes: re-creates only what is missing
        await eventually(lambda: api.get_or_none(f"{SVC_PATH}/chat"), what="Service again")
        await settle(kube)
    second = list(kube)[before:]
    before = len(list(kube))
    with run_operator():  # nothing changed: no writes at all
        await settle(kube, quiet=1.5)
    third = list(kube)[before:]

    def posts(reqs: list[Any], path: str) -> int:
        return len([r for r in reqs if r.method == "POST" and str(r.url).endswith(path)])

    assert posts(second, DEP_PATH) == 0
    assert (posts(second, SVC_PATH), posts(second, PDB_PATH), posts(second, SM_PATH)) == (1, 1, 1)
    assert (await api.get_or_none(f"{DEP_PATH}/chat"))["metadata"]["uid"] == dep["metadata"]["uid"]
    assert [(r.method, str(r.url)) for r in third if r.method != "GET"] == []
    assert created["metadata"]["uid"] == (await api.get_or_none(f"{LLMD_PATH}/chat"))[
        "metadata"]["uid"]


async def test_autoscaling_owns_replicas(kube: Any, api: Api, run_operator: Any) -> None:
    # A long scrape interval: the autoscaler's timer decides once, at the start, and cannot
    # race the replica count this test sets in its place.
    spec = {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                            "scrapeIntervalSeconds": 3600}}
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(**spec), "application/json")
        dep = await eventually(lambda: api.get_or_none(f"{DEP_PATH}/chat"), what="Deployment")
        await eventually(lambda: _observed(api, 1), what="status")
        # The autoscaler scales the Deployment; then the user changes an unrelated field.
        await api.call("PATCH", f"{DEP_PATH}/chat", {"spec": {"replicas": 5}})
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {"maxNumSeqs": 32}}})
        await eventually(lambda: _observed(api, 2), what="observedGeneration 2")
        # Turning autoscaling off hands spec.replicas back to the LLMDeployment.
        await settle(kube)
        dep2 = await api.get_or_none(f"{DEP_PATH}/chat")
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "replicas": 3, "autoscaling": {"enabled": False}}})
        await eventually(lambda: _observed(api, 3), what="observedGeneration 3")
        await settle(kube)
        dep3 = await api.get_or_none(f"{DEP_PATH}/chat")

    assert dep["spec"]["replicas"] == 2  # created with minReplicas
    args = dep2["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert dep2["spec"]["replicas"] == 5  # the autoscaler's count survived the reconcile
    assert dep3["spec"]["replicas"] == 3


def test_handlers_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, argosy_operator.handlers, argosy_operator.reconcile; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'argosy_runtime'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.no_servicemonitor
async def test_no_servicemonitor_without_its_crd(kube: Any, api: Api, run_operator: Any) -> None:
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(replicas=1), "application/json")
        await eventually(lambda: _observed(api, 1), what="status")
        await settle(kube)
    assert await api.get_or_none(f"{DEP_PATH}/chat") is not None
    assert await api.get_or_none(f"{PDB_PATH}/chat") is None  # one replica: no budget
    assert not [r for r in writes(kube) if "servicemonitors" in str(r.url)]


async def recreated(api: Api, url: str, first: dict[str, Any], what: str) -> dict[str, Any]:
    """The object at `url` once it exists again as a new object (another uid than `first`)."""

    async def new_object() -> Any:
        obj = await api.get_or_none(url)
        return obj if obj and obj["metadata"]["uid"] != first["metadata"]["uid"] else None

    return await eventually(new_object, what=f"{what} re-created")


async def test_deployment_deleted_by_hand_is_recreated(kube: Any, api: Api, run_operator: Any
                                                       ) -> None:
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        first = await eventually(lambda: api.get_or_none(f"{DEP_PATH}/chat"), what="Deployment")
        await eventually(lambda: _observed(api, 1), what="status")
        await api.call("DELETE", f"{DEP_PATH}/chat")

        second = await recreated(api, f"{DEP_PATH}/chat", first, "Deployment")
        await settle(kube)
    assert second["spec"] == first["spec"]


CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"
LORA = {"loraAdapters": [{"name": "sql", "path": "/adapters/sql"}]}


def _content(obj: dict[str, Any]) -> Any:
    """What the operator writes of a child: a ConfigMap's data, any other child's spec."""
    return obj["data"] if obj["kind"] == "ConfigMap" else obj["spec"]


@pytest.mark.parametrize("path", [
    SVC_PATH, PDB_PATH, CM_PATH, SM_PATH,
    pytest.param(SVC_PATH, marks=pytest.mark.no_servicemonitor, id="service-without-sm-crd"),
], ids=["service", "pdb", "configmap", "servicemonitor", None])
async def test_child_deleted_by_hand_is_recreated(kube: Any, api: Api, run_operator: Any,
                                                  path: str) -> None:
    """Like the Deployment: a Service, PDB, LoRA ConfigMap or ServiceMonitor deleted by hand
    (or pruned by a GitOps tool) comes back at once, the same, with no change to the
    LLMDeployment (also when the ServiceMonitor CRD is absent and kopf watches the rest)."""
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(runtime=LORA), "application/json")
        first = await eventually(lambda: api.get_or_none(f"{path}/chat"), what="child")
        await eventually(lambda: _observed(api, 1), what="status")
        await api.call("DELETE", f"{path}/chat")

        second = await recreated(api, f"{path}/chat", first, "child")
        await settle(kube)
    assert _content(second) == _content(first)
    assert second["metadata"]["ownerReferences"] == first["metadata"]["ownerReferences"]
    owner = await api.get_or_none(f"{LLMD_PATH}/chat")
    assert owner["metadata"]["generation"] == 1
    assert "created " + second["kind"] + " chat" in [
        r.data["message"] for r in writes(kube, EVENT_PATH)][-3:]


def _container_edit(**fields: Any) -> Any:
    """A hand edit of the runtime container (containers is a list: a merge patch sends it
    whole, as `kubectl edit` does)."""
    def edit(obj: dict[str, Any]) -> dict[str, Any]:
        container = {**obj["spec"]["template"]["spec"]["containers"][0], **fields}
        return {"spec": {"template": {"spec": {"containers": [container]}}}}
    return edit


def _managed(obj: dict[str, Any]) -> Any:
    """What the operator writes of a child: its content, labels and annotations."""
    meta = obj["metadata"]
    return _content(obj), meta.get("labels"), meta.get("annotations")


# A hand edit of each child kind on a field the operator manages, as a function of the live
# object that returns a merge patch.
HAND_EDITS = {
    "deployment-image": (DEP_PATH, _container_edit(image="ghcr.io/someone/else:latest")),
    "deployment-args": (DEP_PATH, _container_edit(args=["serve", "--model", "other"])),
    "deployment-replicas": (DEP_PATH, lambda _: {"spec": {"replicas": 7}}),
    "deployment-label": (DEP_PATH, lambda _: {"metadata": {"labels": {
        "app.kubernetes.io/component": None}}}),
    "deployment-record": (DEP_PATH, lambda _: {"metadata": {"annotations": {
        "argosy.dev/last-applied": None}}}),
    "service": (SVC_PATH, lambda obj: {"spec": {"ports": [
        {**obj["spec"]["ports"][0], "port": 9999}]}}),
    "pdb": (PDB_PATH, lambda _: {"spec": {"maxUnavailable": 0}}),
    "configmap": (CM_PATH, lambda _: {"data": {"adapters.json": "[]"}}),
    "servicemonitor": (SM_PATH, lambda _: {"spec": {"endpoints": []}}),
}


@pytest.mark.parametrize("edit", list(HAND_EDITS))
async def test_child_edited_by_hand_is_reverted(kube: Any, api: Api, run_operator: Any,
                                                edit: str) -> None:
    """`kubectl edit` / `label` / `annotate` on a field the operator manages (the image, the
    args, the replicas it keeps with autoscaling off, a label, its last-applied record, a
    port, the budget, the LoRA list, the scrape endpoints) is put back at once, with no change
    to the LLMDeployment: the same object patched, not re-created."""
    path, change = HAND_EDITS[edit]
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(runtime=LORA), "application/json")
        first = await eventually(lambda: api.get_or_none(f"{path}/chat"), what="child")
        await eventually(lambda: _observed(api, 1), what="status")
        await settle(kube)
        first = await api.get_or_none(f"{path}/chat")
        edited = await api.call("PATCH", f"{path}/chat", change(first))
        assert _managed(edited) != _managed(first)

        async def reverted() -> Any:
            obj = await api.get_or_none(f"{path}/chat")
            return obj if _managed(obj) == _managed(first) else None

        second = await eventually(reverted, what="the hand edit reverted")
        await settle(kube)
        final = await api.get_or_none(f"{path}/chat")
    assert _managed(final) == _managed(first)
    assert final["metadata"]["uid"] == first["metadata"]["uid"]
    assert int(second["metadata"]["resourceVersion"]) > int(edited["metadata"]["resourceVersion"])
    owner = await api.get_or_none(f"{LLMD_PATH}/chat")
    assert owner["metadata"]["generation"] == 1
    # One patch put it back (the Event the operator posts for any write it makes), no loop.
    operator_patches = [r for r in writes(kube, f"{path}/chat") if r.method == "PATCH"
                        and r.headers.get("User-Agent", "").startswith("argosy-operator/")]
    assert len(operator_patches) == 1
    assert "updated " + first["kind"] + " chat" in [
        r.data["message"] for r in writes(kube, EVENT_PATH)]


def _store_cpu_as_the_api_server_spells_it(kube: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deployments store a CPU quantity of "0.5" as "500m" (a real API server canonicalizes
    quantities): the live object then never holds the record of what the operator sent."""
    def canonical(data: Any) -> None:
        if isinstance(data, dict):
            for key, value in data.items():
                if key == "cpu" and value == "0.5":
                    data[key] = "500m"
                else:
                    canonical(value)
        elif isinstance(data, list):
            for value in data:
                canonical(value)

    def wrap(real: Any) -> Any:
        def prepare(request: Any) -> Any:
            if request.resource.plural == "deployments":
                canonical(request.data)
            return real(request)
        return prepare

    for method in ("_prepare_create", "_prepare_patch"):
        monkeypatch.setattr(kube, method, wrap(getattr(kube, method)))


def _count_reconciles(monkeypatch: pytest.MonkeyPatch, field: str) -> list[Any]:
    """Spy on the handlers' reconcile: the list gets each reconciled owner's
    metadata[`field`] (its name, or its generation), in call order."""
    from argosy_operator import handlers

    reconciled: list[Any] = []
    real_reconcile = handlers.reconcile

    async def counted(client: Any, owner: Any) -> Any:
        reconciled.append(owner["metadata"][field])
        return await real_reconcile(client, owner)

    monkeypatch.setattr(handlers, "reconcile", counted)
    return reconciled


async def test_own_writes_and_status_updates_reapply_nothing(
        kube: Any, api: Api, run_operator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only hand edits are drift: the operator's own create and patch (a spec change that
    also changes the replicas it keeps), and the Deployment controller's status updates all
    through a rollout, reconcile nothing more, also when the API server stores a field in its
    own spelling (cpu "0.5" as "500m") so that the child never holds the record literally."""

    reconciled = _count_reconciles(monkeypatch, "generation")
    _store_cpu_as_the_api_server_spells_it(kube, monkeypatch)

    async def rollout(replicas: int, generation: int) -> None:
        for ready in range(replicas + 1):
            await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
                "observedGeneration": generation, "replicas": replicas,
                "updatedReplicas": replicas, "readyReplicas": ready}})

        async def seen() -> bool:
            return (await _status(api)).get("readyReplicas") == replicas

        await eventually(seen, what=f"{replicas} ready replicas in the status")

    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(resources={"cpu": "0.5", "memory": "4Gi"}),
                       "application/json")
        await eventually(lambda: _observed(api, 1), what="status")
        await rollout(2, 1)
        await settle(kube)
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "replicas": 3, "runtime": {"maxNumSeqs": 64}}})
        await eventually(lambda: _observed(api, 2), what="observedGeneration 2")
        await rollout(3, 2)
        await settle(kube, quiet=1.5)
    dep = await api.get_or_none(f"{DEP_PATH}/chat")
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"][
        "cpu"] == "500m"
    assert dep["spec"]["replicas"] == 3
    assert reconciled == [1, 2]  # the create and the spec change, no reapply
    dep_patches = [r for r in writes(kube, f"{DEP_PATH}/chat") if r.method == "PATCH"
                   and r.headers.get("User-Agent", "").startswith("argosy-operator/")]
    assert len(dep_patches) == 1  # the spec change's


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _watches(kube: Any, plural: str) -> list[Any]:
    return [r for r in list(kube) if r.method == "GET" and r.params.get("watch") == "true"
            and r.resource is not None and r.resource.plural == plural]


@pytest.mark.no_servicemonitor
async def test_a_servicemonitor_crd_installed_later_is_used_without_a_spec_change(
        kube: Any, api: Api, run_operator: Any) -> None:
    """The Prometheus Operator installed while the operator runs (clusterwide, as in the
    cluster): the LLMDeployments that ask for a ServiceMonitor (in any namespace) get one at
    once, with no change to them, and one without monitoring gets none; a ServiceMonitor
    deleted by hand then comes back at once, as when the CRD was there at startup (kopf's CRD
    scanning starts the watch)."""
    elsewhere = llmd()
    elsewhere["metadata"]["namespace"] = "team-b"
    other_sm_path = SM_PATH.replace(f"/namespaces/{NS}/", "/namespaces/team-b/")
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await api.call("POST", LLMD_PATH, llmd("plain", monitoring={"serviceMonitor": False}),
                       "application/json")
        await api.call("POST", LLMD_PATH.replace(f"/namespaces/{NS}/", "/namespaces/team-b/"),
                       elsewhere, "application/json")
        for name in ("chat", "plain"):
            await eventually(lambda n=name: _observed(api, 1, n), what=f"{name} status")
        await settle(kube)
        assert await api.get_or_none(f"{SM_PATH}/chat") is None
        await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
        first = await eventually(lambda: api.get_or_none(f"{SM_PATH}/chat"), what="ServiceMonitor")
        await eventually(lambda: api.get_or_none(f"{other_sm_path}/chat"),
                         what="ServiceMonitor in team-b")
        # Delete only once kopf's watch is streaming: a watch started later would not see
        # the deletion (nor would a real one).
        async def watching() -> bool:
            return bool(_watches(kube, "servicemonitors"))

        await eventually(watching, what="a ServiceMonitor watch")
        await settle(kube)
        assert await api.get_or_none(f"{SM_PATH}/plain") is None
        await api.call("DELETE", f"{SM_PATH}/chat")

        second = await recreated(api, f"{SM_PATH}/chat", first, "ServiceMonitor")
        await settle(kube)
    assert second["spec"] == first["spec"]
    assert first["metadata"]["ownerReferences"][0]["name"] == "chat"
    for name in ("chat", "plain"):
        owner = await api.get_or_none(f"{LLMD_PATH}/{name}")
        assert owner["metadata"]["generation"] == 1, name
    assert not [r for r in writes(kube, f"{SM_PATH}/plain")]
    assert "created ServiceMonitor chat" in [r.data["message"] for r in writes(kube, EVENT_PATH)]


@pytest.mark.no_servicemonitor
async def test_the_servicemonitor_crd_found_at_startup_adds_no_reconcile(
        kube: Any, api: Api, run_operator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CRD already installed, kopf's first listing of CRDs reaches the operator's
    CRD handler too: the startup's resume reconcile alone creates the ServiceMonitor, the
    handler does not reconcile every LLMDeployment a second time."""

    reconciled = _count_reconciles(monkeypatch, "name")
    await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
    await api.call("POST", LLMD_PATH, llmd(), "application/json")
    with run_operator():
        await eventually(lambda: api.get_or_none(f"{SM_PATH}/chat"), what="ServiceMonitor")
        await eventually(lambda: _observed(api, 1), what="status")

        async def crds_watched() -> bool:  # the handler's watch, besides kopf's scanning one
            return len(_watches(kube, "customresourcedefinitions")) >= 2

        await eventually(crds_watched, what="two CRD watches")
        await settle(kube, quiet=1.5)
    assert reconciled == ["chat"]


def _discovery_reads(kube: Any) -> list[Any]:
    """The operator's discovery requests for the ServiceMonitor API group."""
    return [r for r in list(kube) if r.method == "GET"
            and r.url.path == "/apis/monitoring.coreos.com/v1"
            and r.headers.get("User-Agent", "").startswith("argosy-operator/")]


@pytest.mark.no_servicemonitor
async def test_namespaced_a_servicemonitor_crd_installed_later_is_used_without_a_restart(
        kube: Any, api: Api, run_operator: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """With `-n` (no CRD watch) the recheck timer notices the CRD: while it is absent a tick
    reads discovery and does nothing else; once it is installed, the LLMDeployment that asks
    for a ServiceMonitor gets one (no spec change, no restart), the one that does not gets
    none, and later ticks write nothing."""
    from argosy_operator import handlers

    assert handlers.SERVICEMONITOR_RECHECK_SECONDS <= 2, "set before handlers was imported"
    reconciled = _count_reconciles(monkeypatch, "name")
    caplog.set_level(logging.INFO, logger="argosy.operator")
    with run_operator(namespace=NS):
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await api.call("POST", LLMD_PATH, llmd("plain", monitoring={"serviceMonitor": False}),
                       "application/json")
        for name in ("chat", "plain"):
            await eventually(lambda n=name: _observed(api, 1, n), what=f"{name} status")
        await settle(kube)
        before = len(_discovery_reads(kube))
        count = len(writes(kube))

        async def ticked() -> bool:
            return len(_discovery_reads(kube)) > before

        await eventually(ticked, what="a timer tick without the CRD")
        await settle(kube)
        assert len(writes(kube)) == count  # the tick wrote nothing
        assert sorted(reconciled) == ["chat", "plain"]
        assert await api.get_or_none(f"{SM_PATH}/chat") is None

        await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
        sm = await eventually(lambda: api.get_or_none(f"{SM_PATH}/chat"), what="ServiceMonitor")
        await settle(kube)
        count = len(writes(kube))
        before = len(_discovery_reads(kube))
        await eventually(ticked, what="a timer tick with the ServiceMonitor there")
        await settle(kube)
        assert len(writes(kube)) == count
    assert sorted(reconciled) == ["chat", "chat", "plain"]
    assert sm["metadata"]["ownerReferences"][0]["name"] == "chat"
    assert await api.get_or_none(f"{SM_PATH}/plain") is None
    for name in ("chat", "plain"):
        owner = await api.get_or_none(f"{LLMD_PATH}/{name}")
        assert owner["metadata"]["generation"] == 1, name
    assert "created ServiceMonitor chat" in [r.data["message"] for r in writes(kube, EVENT_PATH)]
    # The timer did it (a CRD handler left registered by a clusterwide run in this process
    # may watch CRDs here, but does nothing in a namespaced run).
    assert "ServiceMonitor ml/chat is missing" in caplog.text


@pytest.mark.no_servicemonitor
async def test_the_servicemonitor_recheck_costs_one_request_until_it_has_work(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tick of the timer, called directly: without the CRD, one discovery request and
    nothing else; with the CRD and no ServiceMonitor, a reconcile that creates it; with the
    ServiceMonitor there, two reads and no reconcile."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)) as events:
        reconciled = _count_reconciles(monkeypatch, "name")
        owner = await api.get_or_none(f"{LLMD_PATH}/chat")

        async def tick() -> list[Any]:
            seen = len(list(kube))
            await handlers.servicemonitor_recheck(meta=owner["metadata"], namespace=NS)
            return list(kube)[seen:]

        requests = await tick()
        assert [(r.method, r.url.path) for r in requests] == [
            ("GET", "/apis/monitoring.coreos.com/v1")]
        assert reconciled == []
        await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
        await tick()
        assert reconciled == ["chat"]
        sm = await api.get_or_none(f"{SM_PATH}/chat")
        assert sm is not None and sm["metadata"]["ownerReferences"][0]["name"] == "chat"
        assert "created ServiceMonitor chat" in [e["message"] for e in events]
        requests = await tick()
        assert [r.method for r in requests] == ["GET", "GET"]
        assert reconciled == ["chat"]


async def test_reconciles_share_one_discovery_request(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reconciles within DISCOVERY_CACHE_SECONDS ask discovery once between them, not once
    each (a restart resumes every LLMDeployment at once)."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        owner = await api.get_or_none(f"{LLMD_PATH}/chat")
        for _ in range(4):
            await handlers.reconcile_llmdeployment(body=owner, meta=owner["metadata"],
                                                   logger=logging.getLogger("test"))
    assert len(_discovery_reads(kube)) == 1
    assert await api.get_or_none(f"{SM_PATH}/chat") is not None


@pytest.mark.no_servicemonitor
@pytest.mark.parametrize("path", ["recheck-timer", "crd-handler"])
async def test_a_cached_absent_answer_does_not_delay_noticing_the_crd(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Reconciles cached "no ServiceMonitor API"; then the CRD is installed. The namespaced
    recheck timer and the clusterwide CRD handler ask discovery afresh and create the
    ServiceMonitor at once, not a cache lifetime later; the CRD handler drops the cached
    answer on the CRD's DELETED event."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        owner = await api.get_or_none(f"{LLMD_PATH}/chat")
        await handlers.reconcile_llmdeployment(body=owner, meta=owner["metadata"],
                                               logger=logging.getLogger("test"))
        assert len(_discovery_reads(kube)) == 1  # "absent", cached for the second reconcile
        crd = await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
        reconciled = _count_reconciles(monkeypatch, "name")
        if path == "recheck-timer":
            await handlers.servicemonitor_recheck(meta=owner["metadata"], namespace=NS)
        else:
            monkeypatch.setitem(handlers._state, "clusterwide", True)
            monkeypatch.setattr(handlers, "_established_crds", set())
            await handlers.servicemonitor_crd_changed(
                event={"type": "ADDED", "object": crd}, body=crd, meta=crd["metadata"])
        assert reconciled == ["chat"]
        assert await api.get_or_none(f"{SM_PATH}/chat") is not None
        assert len(_discovery_reads(kube)) == 2  # the fresh one; the reconcile reused it
        if path == "crd-handler":
            await handlers.servicemonitor_crd_changed(
                event={"type": "DELETED", "object": crd}, body=crd, meta=crd["metadata"])
            await handlers.reconcile_llmdeployment(body=owner, meta=owner["metadata"],
                                                   logger=logging.getLogger("test"))
            assert len(_discovery_reads(kube)) == 3


def _fail_get_once(kube: Any, monkeypatch: pytest.MonkeyPatch,
                   path: str = "/apis/monitoring.coreos.com/v1") -> list[int]:
    """The next GET of `path` (by default the ServiceMonitor discovery request) gets a
    proxy's plain-text 503. Returns a list emptied when it has."""
    import aiohttp.web

    handle, failures = kube._handle, [1]

    async def proxy_hiccup(request: Any) -> Any:
        if request.method == "GET" and failures and request.url.path == path:
            failures.pop()
            return aiohttp.web.Response(status=503, text="upstream connect error")
        return await handle(request)

    monkeypatch.setattr(kube, "_handle", proxy_hiccup)
    return failures


@pytest.mark.no_servicemonitor
@pytest.mark.parametrize("path", ["recheck-timer", "crd-handler"])
async def test_a_discovery_5xx_does_not_stop_noticing_the_crd(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, path: str) -> None:
    """Discovery answering a plain-text 503 (an error, not "absent", since reconciles must not
    take it for a missing CRD): the recheck timer logs one line and checks again at its next
    tick, which creates the ServiceMonitor; the CRD handler asks again and reconciles."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        owner = await api.get_or_none(f"{LLMD_PATH}/chat")
        crd = await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
        reconciled = _count_reconciles(monkeypatch, "name")
        _fail_get_once(kube, monkeypatch)
        with caplog.at_level(logging.WARNING, logger="argosy.operator"):
            if path == "recheck-timer":
                await handlers.servicemonitor_recheck(meta=owner["metadata"], namespace=NS)
                assert reconciled == []
                await handlers.servicemonitor_recheck(meta=owner["metadata"], namespace=NS)
            else:
                monkeypatch.setitem(handlers._state, "clusterwide", True)
                monkeypatch.setattr(handlers, "_established_crds", set())
                await handlers.servicemonitor_crd_changed(
                    event={"type": "ADDED", "object": crd}, body=crd, meta=crd["metadata"])
        assert reconciled == ["chat"]
        assert await api.get_or_none(f"{SM_PATH}/chat") is not None
        lines = [r for r in caplog.records if r.name == "argosy.operator"]
        assert len(lines) == 1 and lines[0].exc_info is None, lines
        assert "upstream connect error" in lines[0].getMessage()


@pytest.mark.no_servicemonitor
async def test_a_failed_list_of_owners_does_not_lose_the_crds_reconciles(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRD handler marks the CRD seen, then lists the LLMDeployments to reconcile. A 503
    on that list escaped the handler (kopf never retries an event handler), and with the CRD
    already marked seen no later event of it tried again: no ServiceMonitor until a restart
    or a spec change. The list is retried, as the discovery request before it is."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        crd = await api.call("POST", CRD_PATH, SERVICEMONITOR_CRD, "application/json")
        reconciled = _count_reconciles(monkeypatch, "name")
        failures = _fail_get_once(kube, monkeypatch, "/apis/argosy.dev/v1alpha1/llmdeployments")
        monkeypatch.setitem(handlers._state, "clusterwide", True)
        monkeypatch.setattr(handlers, "_established_crds", set())
        await handlers.servicemonitor_crd_changed(
            event={"type": "ADDED", "object": crd}, body=crd, meta=crd["metadata"])
        assert failures == []  # the list did fail once
        assert reconciled == ["chat"]
        assert await api.get_or_none(f"{SM_PATH}/chat") is not None


def test_the_servicemonitor_recheck_runs_only_namespaced_and_where_wanted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from argosy_operator import handlers

    wants, plain = llmd(), llmd(monitoring={"serviceMonitor": False})
    monkeypatch.setitem(handlers._state, "clusterwide", True)
    assert not handlers._recheck_servicemonitor(body=wants)
    monkeypatch.setitem(handlers._state, "clusterwide", False)
    assert handlers._recheck_servicemonitor(body=wants)
    assert not handlers._recheck_servicemonitor(body=plain)


async def test_children_the_spec_drops_stay_deleted(kube: Any, api: Api, run_operator: Any
                                                    ) -> None:
    """The operator's own deletions (a spec change dropping the PDB, the ServiceMonitor and
    the LoRA ConfigMap) reach the same watch, and the reconcile they trigger reads the current
    spec: nothing comes back. A Service deleted by hand first shows that the watch is live."""
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(runtime=LORA), "application/json")
        svc = await eventually(lambda: api.get_or_none(f"{SVC_PATH}/chat"), what="Service")
        for path in (PDB_PATH, SM_PATH, CM_PATH):
            await eventually(lambda p=path: api.get_or_none(f"{p}/chat"), what=path)
        await eventually(lambda: _observed(api, 1), what="status")
        await api.call("DELETE", f"{SVC_PATH}/chat")

        async def service_back() -> Any:
            back = await api.get_or_none(f"{SVC_PATH}/chat")
            return back if back and back["metadata"]["uid"] != svc["metadata"]["uid"] else None

        await eventually(service_back, what="Service re-created")
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "replicas": 1, "monitoring": {"serviceMonitor": False},
            "runtime": {"loraAdapters": None}}})

        async def dropped() -> bool:
            return all([await api.get_or_none(f"{p}/chat") is None
                        for p in (PDB_PATH, SM_PATH, CM_PATH)])

        await eventually(dropped, what="PDB, ServiceMonitor and ConfigMap deleted")
        await eventually(lambda: _observed(api, 2), what="observedGeneration 2")
        await settle(kube, quiet=1.5)
    for path in (PDB_PATH, SM_PATH, CM_PATH):
        assert await api.get_or_none(f"{path}/chat") is None, path
        assert [r.method for r in writes(kube, f"{path}/chat")] == ["DELETE"], path
        assert len([r for r in writes(kube, path) if r.method == "POST"]) == 1, path


async def test_reapply_waits_for_a_spec_change_in_flight(kube: Any, api: Api,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A reapply (the Service deleted by hand) that read the spec just before a change that
    drops the PDB must not write after that change's reconcile: the older spec would bring the
    PDB back for good. Reconciles of one LLMDeployment take turns, and the reapply reads the
    spec in its turn. The handlers are called directly, the reapply held after its read."""
    import asyncio

    import kopf
    from argosy_operator import handlers
    from argosy_operator.kube import KubeClient

    log = logging.getLogger("test")
    monkeypatch.setattr(kopf, "event", lambda *args, **kwargs: None)  # no kopf context here
    client = KubeClient(str(kube.url))
    monkeypatch.setitem(handlers._state, "client", client)
    real_reconcile = handlers.reconcile
    read = asyncio.Event()
    started: list[int] = []
    finished: list[int] = []  # spec.replicas of each reconcile, in the order they ended

    async def held_reconcile(c: Any, owner: Any) -> Any:
        started.append(owner["spec"]["replicas"])
        if len(started) == 2:  # the reapply: the owner is read, now the spec changes
            read.set()
            await asyncio.sleep(0.5)
        result = await real_reconcile(c, owner)
        finished.append(owner["spec"]["replicas"])
        return result

    monkeypatch.setattr(handlers, "reconcile", held_reconcile)
    try:
        v1 = await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await handlers.reconcile_llmdeployment(body=v1, meta=v1["metadata"], logger=log)
        assert await api.get_or_none(f"{PDB_PATH}/chat") is not None
        await api.call("DELETE", f"{SVC_PATH}/chat")
        reapply = asyncio.create_task(handlers._refresh_owner(NS, "chat", reapply=True))
        await read.wait()
        v2 = await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"replicas": 1}})
        await handlers.reconcile_llmdeployment(body=v2, meta=v2["metadata"], logger=log)
        await reapply
    finally:
        await client.close()
    assert finished == [2, 2, 1]  # the change's reconcile ran after the reapply's
    assert await api.get_or_none(f"{SVC_PATH}/chat") is not None
    assert await api.get_or_none(f"{PDB_PATH}/chat") is None
    assert [r.method for r in writes(kube, f"{PDB_PATH}/chat")] == ["DELETE"]


@contextlib.asynccontextmanager
async def reconciled_by_the_handlers(kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch,
                                     retry_delays: tuple[float, ...]
                                     ) -> AsyncIterator[list[dict[str, Any]]]:
    """The handlers called directly (no kopf) on a client of the emulated API server, with
    an LLMDeployment created and reconciled once; yields the events they post."""
    import kopf
    from argosy_operator import handlers
    from argosy_operator.kube import KubeClient

    events: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda _obj, **kw: events.append(kw))
    monkeypatch.setattr(handlers, "REAPPLY_RETRY_DELAYS", retry_delays)
    client = KubeClient(str(kube.url))
    monkeypatch.setitem(handlers._state, "client", client)
    try:
        v1 = await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await handlers.reconcile_llmdeployment(body=v1, meta=v1["metadata"],
                                               logger=logging.getLogger("test"))
        yield events
    finally:
        await client.close()


async def test_a_foreign_object_in_a_deleted_childs_place_is_reported(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Service deleted by hand and someone else's Service created under its name: the
    reapply leaves the foreign object alone and reports Degraded=ChildConflict on the owner
    (an event handler is not retried by kopf, so an exception would only reach the log). It
    keeps trying: once the foreign Service is gone, ours comes back and Degraded clears."""
    import asyncio

    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)) as events:
        await api.call("DELETE", f"{SVC_PATH}/chat")
        foreign = {"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "chat", "namespace": NS, "labels": {"team": "web"}},
                   "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}
        await api.call("POST", SVC_PATH, foreign, "application/json")
        reapply = asyncio.create_task(handlers._refresh_owner(NS, "chat", reapply=True))
        degraded = await wait_for_degraded(api, "ChildConflict")
        assert degraded["status"] == "True"
        assert "Service chat exists and is not managed by argosy-operator" in \
            degraded["message"]
        svc = await api.get_or_none(f"{SVC_PATH}/chat")
        assert svc["spec"]["selector"] == {"app": "web"}
        assert "ownerReferences" not in svc["metadata"]
        assert not reapply.done()  # still retrying
        await api.call("DELETE", f"{SVC_PATH}/chat")  # the foreign Service goes away
        await asyncio.wait_for(reapply, timeout=15)
    ours = await api.get_or_none(f"{SVC_PATH}/chat")
    assert ours["metadata"]["ownerReferences"][0]["name"] == "chat"
    assert _cond(await _status(api), "Degraded").get("reason") != "ChildConflict"
    assert [e["reason"] for e in events if e["type"] == "Warning"] == ["ChildConflict"]
    assert "created Service chat" in [e["message"] for e in events]


OPERATOR_LABELS = ("app.kubernetes.io/managed-by", "argosy.dev/llmdeployment")


@pytest.mark.parametrize("path", [DEP_PATH, SVC_PATH], ids=["deployment", "service"])
@pytest.mark.parametrize("label", OPERATOR_LABELS)
async def test_a_child_whose_operator_label_was_removed_gets_it_back(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch, path: str, label: str) -> None:
    """`kubectl label deploy chat app.kubernetes.io/managed-by-`: the child leaves the
    operator's label-filtered watch, and the owner's next reconcile (here the reapply path)
    recognises it by its controller reference and patches the label back: the same object,
    no ChildConflict."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)) as events:
        first = await api.get_or_none(f"{path}/chat")
        edited = await api.call("PATCH", f"{path}/chat", {"metadata": {"labels": {label: None}}})
        assert label not in edited["metadata"]["labels"]
        assert await handlers._try_reapply(handlers.get_client(), NS, "chat", first_try=True)
    final = await api.get_or_none(f"{path}/chat")
    assert final["metadata"]["uid"] == first["metadata"]["uid"]
    assert final["metadata"]["labels"] == first["metadata"]["labels"]
    assert final["metadata"]["ownerReferences"] == first["metadata"]["ownerReferences"]
    assert _cond(await _status(api), "Degraded").get("reason") != "ChildConflict"
    assert not [e for e in events if e["type"] == "Warning"]
    assert "updated " + first["kind"] + " chat" in [e["message"] for e in events]


async def test_a_child_without_its_labels_is_restored_on_a_spec_change(
        kube: Any, api: Api, run_operator: Any) -> None:
    """Both operator labels removed from the Deployment by hand (no watch event reaches the
    operator), then a spec change: the reconcile patches the Deployment, labels included,
    in place, and reports no conflict."""
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")
        await eventually(lambda: _observed(api, 1), what="status")
        await settle(kube)
        first = await api.get_or_none(f"{DEP_PATH}/chat")
        await api.call("PATCH", f"{DEP_PATH}/chat", {"metadata": {"labels": dict.fromkeys(
            OPERATOR_LABELS)}})
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {"maxNumSeqs": 64}}})
        await eventually(lambda: _observed(api, 2), what="observedGeneration 2")
        await settle(kube)
    final = await api.get_or_none(f"{DEP_PATH}/chat")
    assert final["metadata"]["uid"] == first["metadata"]["uid"]
    assert final["metadata"]["labels"] == first["metadata"]["labels"]
    assert "--max-num-seqs" in final["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _cond(await _status(api), "Degraded").get("status") == "False"
    assert not [r for r in writes(kube, EVENT_PATH) if r.data["type"] == "Warning"]


async def test_a_dropped_child_without_its_label_is_still_deleted(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PDB's managed-by label removed by hand, then a scale to one replica: the PDB is
    still the operator's (its controller reference) and goes, as it would with the label."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("PATCH", f"{PDB_PATH}/chat", {"metadata": {"labels": {
            OPERATOR_LABELS[0]: None}}})
        v2 = await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"replicas": 1}})
        await handlers.reconcile_llmdeployment(body=v2, meta=v2["metadata"],
                                               logger=logging.getLogger("test"))
    assert await api.get_or_none(f"{PDB_PATH}/chat") is None


async def test_an_object_controlled_by_something_else_is_still_a_conflict(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object in a child's place with a controller reference, but to another owner (not
    this LLMDeployment's uid), is someone else's: ChildConflict, left as it is."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)) as events:
        other = await api.call("POST", CM_PATH, {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "web-owner", "namespace": NS}}, "application/json")
        await api.call("DELETE", f"{SVC_PATH}/chat")
        ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "web-owner",
               "uid": other["metadata"]["uid"], "controller": True}
        await api.call("POST", SVC_PATH, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "chat", "namespace": NS, "ownerReferences": [ref]},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}},
            "application/json")
        assert not await handlers._try_reapply(handlers.get_client(), NS, "chat",
                                               first_try=True)
    svc = await api.get_or_none(f"{SVC_PATH}/chat")
    assert svc["metadata"]["ownerReferences"] == [ref]
    assert svc["spec"]["selector"] == {"app": "web"}
    assert _cond(await _status(api), "Degraded").get("reason") == "ChildConflict"
    assert [e["reason"] for e in events if e["type"] == "Warning"] == ["ChildConflict"]


def _fail_service_creates(kube: Any, monkeypatch: pytest.MonkeyPatch, times: float) -> list[int]:
    """The emulated API server answers the next `times` Service creates with 503 (before
    storing anything, as an API server whose etcd is down would); returns a list that grows
    by one entry per failure served."""
    import kmock

    failed: list[int] = []
    prepare = kube._prepare_create

    def failing_prepare(request: Any) -> None:
        if request.resource.plural == "services" and len(failed) < times:
            failed.append(503)
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                        message="etcdserver: request timed out")
        prepare(request)

    monkeypatch.setattr(kube, "_prepare_create", failing_prepare)
    return failed


async def test_a_failed_reapply_is_retried_until_it_succeeds(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Service deleted by hand while the API server fails writes: kopf does not retry
    event handlers, so the reapply retries itself with backoff (one ApplyFailed Warning, not
    one per try) and the Service comes back once the API server recovers, with no spec change,
    restart or other event."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.01, 0.02)) as events:
        first = await api.get_or_none(f"{SVC_PATH}/chat")
        await api.call("DELETE", f"{SVC_PATH}/chat")
        failed = _fail_service_creates(kube, monkeypatch, times=3)
        await handlers._refresh_owner(NS, "chat", reapply=True)
    assert len(failed) == 3
    svc = await api.get_or_none(f"{SVC_PATH}/chat")
    assert svc is not None and svc["spec"] == first["spec"]
    assert [(e["reason"], "503" in e["message"]) for e in events if e["type"] == "Warning"] \
        == [("ApplyFailed", True)]
    assert "created Service chat" in [e["message"] for e in events]


async def test_a_failing_reapply_stops_when_its_owner_is_deleted(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries end with the LLMDeployment: nothing is re-created for an owner that is gone."""
    import asyncio

    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("DELETE", f"{SVC_PATH}/chat")
        failed = _fail_service_creates(kube, monkeypatch, times=float("inf"))
        reapply = asyncio.create_task(handlers._refresh_owner(NS, "chat", reapply=True))

        async def tried_twice() -> bool:
            return len(failed) >= 2

        await eventually(tried_twice, what="two failed tries")
        await api.call("DELETE", f"{LLMD_PATH}/chat")
        await asyncio.wait_for(reapply, timeout=15)
    assert await api.get_or_none(f"{SVC_PATH}/chat") is None


def test_reapply_retries_back_off_then_repeat_the_longest_wait() -> None:
    from argosy_operator.handlers import REAPPLY_RETRY_DELAYS, reapply_retry_delay

    delays = [reapply_retry_delay(attempt) for attempt in range(8)]
    assert delays[:len(REAPPLY_RETRY_DELAYS)] == list(REAPPLY_RETRY_DELAYS)
    assert delays == sorted(delays) and delays[0] < delays[-1]
    assert delays[-3:] == [max(REAPPLY_RETRY_DELAYS)] * 3


async def test_spec_the_crd_would_reject_is_reported_not_applied(kube: Any, api: Api,
                                                                 run_operator: Any) -> None:
    """An object admitted under a stale CRD (no CEL rules): Degraded/InvalidSpec, no children."""
    kube.crd_validation = False
    bad = llmd()
    bad["spec"]["model"]["source"] = "hf://org/name"  # and path: two sources
    with run_operator():
        await api.call("POST", LLMD_PATH, bad, "application/json")
        cond = await wait_for_degraded(api, "InvalidSpec")
        await settle(kube)
    assert cond["status"] == "True"
    assert "spec.model: set exactly one of source or path" in cond["message"]
    assert await api.get_or_none(f"{DEP_PATH}/chat") is None
    warnings = [r.data for r in writes(kube, EVENT_PATH) if r.data["type"] == "Warning"]
    assert [w["reason"] for w in warnings] == ["InvalidSpec"]  # once: a permanent error


async def test_foreign_object_with_a_childs_name_is_left_alone(kube: Any, api: Api,
                                                              run_operator: Any) -> None:
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "chat", "namespace": NS, "labels": {"team": "web"}},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}
    await api.call("POST", SVC_PATH, foreign, "application/json")
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(), "application/json")

        async def conflict() -> Any:
            events = [r.data for r in writes(kube, EVENT_PATH)]
            return [e for e in events if e["reason"] == "ChildConflict"]

        (event,) = await eventually(conflict, what="ChildConflict event")
        await settle(kube)
    assert "Service chat exists and is not managed by argosy-operator" in event["message"]
    degraded = _cond(await _status(api), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildConflict")
    svc = await api.get_or_none(f"{SVC_PATH}/chat")
    assert svc["spec"]["selector"] == {"app": "web"} and "ownerReferences" not in svc["metadata"]
    assert not [r for r in writes(kube, f"{SVC_PATH}/chat") if r.method == "PATCH"]
