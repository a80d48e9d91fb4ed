"""LoRA adapters live in a ConfigMap the runtime re-reads, so changing them rolls no pod."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from argosy_operator.builders import build_deployment, build_lora_configmap
from argosy_operator.spec import normalize_spec
from crd_schema import validate
from operator_helpers import NS, Api, eventually, settle, wait_for_degraded
from test_operator_manifests import K8S_VERSION

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"
EVENT_PATH = f"/api/v1/namespaces/{NS}/events"

SQL = {"name": "sql", "path": "/adapters/sql"}
CHAT = {"name": "chat:v2", "path": "/adapters/chat"}
VOLUME = {"name": "lora-adapters", "configMap": {"name": "x"}}
MOUNT = {"name": "lora-adapters", "mountPath": "/etc/argosy/lora", "readOnly": True}


def _llmd(**runtime: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = {"model": {"name": "m", "path": "/models/m"}, "runtime": runtime,
            "podTemplate": {"volumes": [{"name": "adapters", "persistentVolumeClaim": {
                "claimName": "adapters"}}],
                "volumeMounts": [{"name": "adapters", "mountPath": "/adapters"}]}}
    llmd = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "x", "namespace": "ns",
                         "uid": "0b3c8a4e-0000-4000-8000-000000000001"},
            "spec": spec}
    return llmd, normalize_spec(spec)


def _pod(**runtime: Any) -> dict[str, Any]:
    llmd, spec = _llmd(**runtime)
    return build_deployment(llmd, spec, replicas=1)["spec"]["template"]["spec"]


# --- builders --------------------------------------------------------------------------------

def test_configmap_holds_the_adapter_map() -> None:
    llmd, spec = _llmd(loraAdapters=[SQL, CHAT])
    assert build_lora_configmap(llmd, spec) == {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "x", "namespace": "ns", "labels": {
            "app.kubernetes.io/name": "argosy-runtime", "app.kubernetes.io/instance": "x",
            "app.kubernetes.io/component": "llm-server",
            "app.kubernetes.io/managed-by": "argosy-operator",
            "argosy.dev/llmdeployment": "x"},
            "ownerReferences": [{"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                                 "name": "x", "uid": llmd["metadata"]["uid"],
                                 "controller": True}]},
        # Sorted, no spaces: the same list always gives the same bytes (no no-op patches).
        "data": {"adapters.json": '{"chat:v2":"/adapters/chat","sql":"/adapters/sql"}'},
    }


def test_runtime_mounts_the_configmap_and_reads_the_file() -> None:
    pod = _pod(loraAdapters=[SQL])
    runtime = pod["containers"][0]
    assert VOLUME in pod["volumes"] and MOUNT in runtime["volumeMounts"]
    # The user's volumes come last, as without adapters.
    assert pod["volumes"][-1]["name"] == "adapters"
    assert runtime["volumeMounts"][-1]["name"] == "adapters"
    args = runtime["args"]
    assert args[args.index("--lora-modules-file") + 1] == "/etc/argosy/lora/adapters.json"
    assert "--lora-modules" not in args


def test_pod_template_does_not_depend_on_the_adapter_list() -> None:
    """The point of the ConfigMap: a different adapter list leaves the Deployment byte for
    byte the same, so the three-way patch is empty and no pod restarts."""
    deployments = []
    for adapters in ([SQL], [CHAT, {"name": "sql", "path": "/adapters/sql-v2"}], []):
        llmd, spec = _llmd(loraAdapters=adapters)
        deployments.append(json.dumps(build_deployment(llmd, spec, replicas=1),
                                      sort_keys=True))
    assert deployments[0] == deployments[1] == deployments[2]


def test_empty_list_keeps_the_file_and_the_mount() -> None:
    llmd, spec = _llmd(loraAdapters=[])
    assert build_lora_configmap(llmd, spec)["data"] == {"adapters.json": "{}"}
    pod = _pod(loraAdapters=[])
    assert VOLUME in pod["volumes"] and MOUNT in pod["containers"][0]["volumeMounts"]
    assert "--lora-modules-file" in pod["containers"][0]["args"]


def test_absent_field_means_no_configmap_no_mount_no_flag() -> None:
    llmd, spec = _llmd()
    assert build_lora_configmap(llmd, spec) is None
    pod = _pod()
    assert all(v["name"] != "lora-adapters" for v in pod["volumes"])
    assert all(m["name"] != "lora-adapters" for m in pod["containers"][0]["volumeMounts"])
    assert not any(a.startswith("--lora-modules") for a in pod["containers"][0]["args"])


@pytest.mark.parametrize("adapters", [[SQL, CHAT], []], ids=["two", "empty"])
def test_children_validate_against_the_crd_and_kubernetes_schemas(
        adapters: list[dict[str, str]]) -> None:
    llmd, _ = _llmd(loraAdapters=adapters)
    obj, errors = validate(llmd)  # the CRD accepts the list, an empty one too
    assert errors == []
    spec = normalize_spec(obj["spec"])
    for child in (build_lora_configmap(llmd, spec), build_deployment(llmd, spec, replicas=1)):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def _runtime_engine_args(args: list[str]) -> Any:
    """`args` (after `argosy`) through the runtime's own parser and EngineArgs checks, as
    the container's `argosy serve` reads them (the model is not loaded)."""
    from argosy_runtime.cli.main import build_parser
    from argosy_runtime.engine_args import EngineArgs

    return EngineArgs.from_cli_args(build_parser().parse_args(args))


def test_adapter_caps_become_serve_flags_the_runtime_accepts() -> None:
    args = _pod(loraAdapters=[SQL], maxLoras=2, maxLoadedLoras=8)["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "2"
    assert args[args.index("--max-loaded-loras") + 1] == "8"
    engine_args = _runtime_engine_args(args)
    assert (engine_args.max_loras, engine_args.max_loaded_loras) == (2, 8)
    assert engine_args.lora_modules_file == "/etc/argosy/lora/adapters.json"


@pytest.mark.parametrize("caps,flags", [
    ({"maxLoras": 3}, ["--max-loras", "3"]),
    ({"maxLoadedLoras": 1}, ["--max-loaded-loras", "1"]),
    ({}, []),
], ids=["per-step only", "loaded only", "neither"])
def test_each_cap_is_rendered_only_when_set(caps: dict[str, int], flags: list[str]) -> None:
    args = _pod(loraAdapters=[SQL], **caps)["containers"][0]["args"]
    assert [a for a in args if a in ("--max-loras", "--max-loaded-loras")] == flags[::2]
    for flag, value in zip(flags[::2], flags[1::2]):
        assert args[args.index(flag) + 1] == value
    engine_args = _runtime_engine_args(args)
    assert engine_args.max_loras == caps.get("maxLoras")
    assert engine_args.max_loaded_loras == caps.get("maxLoadedLoras")


def test_caps_the_runtime_would_refuse_are_refused_before_any_child() -> None:
    """maxLoras > maxLoadedLoras: the CRD's CEL rule rejects it at apply; an object admitted
    under an older CRD fails normalize_spec (Degraded=InvalidSpec) instead of rolling out
    pods whose `argosy serve` exits at once."""
    llmd, _ = _llmd(loraAdapters=[SQL])
    llmd["spec"]["runtime"].update(maxLoras=4, maxLoadedLoras=2)
    _, errors = validate(llmd)
    assert any("runtime.maxLoras must be <= runtime.maxLoadedLoras" in e for e in errors), errors
    with pytest.raises(ValueError, match=r"spec\.runtime\.maxLoras"):
        normalize_spec(llmd["spec"])
    with pytest.raises(ValueError, match="max_loras"):  # what the runtime would have said
        _runtime_engine_args(["serve", "--max-loras", "4", "--max-loaded-loras", "2"])


# --- the operator against the emulated API server --------------------------------------------

def _body(**runtime: Any) -> dict[str, Any]:
    return {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "chat", "namespace": NS},
            "spec": {"model": {"name": "smollm2", "path": "smollm2-135m"}, "replicas": 2,
                     "runtime": runtime}}


async def _observed(api: Api, generation: int) -> bool:
    obj = await api.get_or_none(f"{LLMD_PATH}/chat")
    return (obj or {}).get("status", {}).get("observedGeneration") == generation


async def _adapters_file(api: Api) -> Any:
    cm = await api.get_or_none(f"{CM_PATH}/chat")
    return None if cm is None else json.loads(cm["data"]["adapters.json"])


def _writes(requests: list[Any], path: str) -> list[tuple[str, str]]:
    return [(r.method, str(r.url)) for r in requests
            if r.method in ("POST", "PATCH", "PUT", "DELETE") and path in str(r.url)]


async def test_adapter_changes_patch_the_configmap_and_roll_no_pod(
        kube: Any, api: Api, run_operator: Any) -> None:
    with run_operator():
        created = await api.call("POST", LLMD_PATH, _body(loraAdapters=[SQL]),
                                 "application/json")
        await eventually(lambda: _observed(api, 1), what="first reconcile")
        await settle(kube)
        cm = await api.get_or_none(f"{CM_PATH}/chat")
        dep = await api.get_or_none(f"{DEP_PATH}/chat")
        before = len(list(kube))

        # Another list, then none at all: only the ConfigMap changes.
        two = [{"name": "sql", "path": "/adapters/sql-v2"}, CHAT]
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {"loraAdapters": two}}})
        await eventually(lambda: _observed(api, 2), what="adapters changed")
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {"loraAdapters": []}}})
        await eventually(lambda: _observed(api, 3), what="adapters emptied")
        await settle(kube)
        adapter_changes = list(kube)[before:]
        emptied = await _adapters_file(api)
        dep_after_changes = await api.get_or_none(f"{DEP_PATH}/chat")

        # Dropping the field takes the mount off (one rollout) and deletes the ConfigMap.
        await api.call("PATCH", f"{LLMD_PATH}/chat",
                       {"spec": {"runtime": {"loraAdapters": None}}})
        await eventually(lambda: _observed(api, 4), what="field removed")
        await settle(kube)
        dep_without = await api.get_or_none(f"{DEP_PATH}/chat")
        cm_without = await api.get_or_none(f"{CM_PATH}/chat")

    assert json.loads(cm["data"]["adapters.json"]) == {"sql": "/adapters/sql"}
    assert cm["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "lora-adapters", "configMap": {"name": "chat"}} in pod["volumes"]
    assert "--lora-modules-file" in pod["containers"][0]["args"]

    # Two adapter changes: two ConfigMap patches, not one Deployment write (no rollout).
    assert [m for m, _ in _writes(adapter_changes, f"{CM_PATH}/chat")] == ["PATCH", "PATCH"]
    assert _writes(adapter_changes, DEP_PATH) == []
    assert dep_after_changes["metadata"]["generation"] == dep["metadata"]["generation"]
    assert dep_after_changes["spec"]["template"] == dep["spec"]["template"]
    assert emptied == {}

    assert cm_without is None
    assert dep_without["metadata"]["generation"] == dep["metadata"]["generation"] + 1
    pod = dep_without["spec"]["template"]["spec"]
    assert all(v["name"] != "lora-adapters" for v in pod["volumes"])
    assert not any(a.startswith("--lora-modules") for a in pod["containers"][0]["args"])
    messages = [r.data["message"] for r in list(kube)
                if r.method == "POST" and EVENT_PATH in str(r.url)]
    assert {"created ConfigMap chat", "updated ConfigMap chat",
            "deleted ConfigMap chat"} <= set(messages)


async def test_a_users_configmap_with_the_same_name_is_left_alone(
        kube: Any, api: Api, run_operator: Any) -> None:
    """Without loraAdapters, a foreign ConfigMap named like the LLMDeployment is none of the
    operator's business; with them, it is a name clash, reported before any pod mounts it."""
    await api.call("POST", CM_PATH, {"apiVersion": "v1", "kind": "ConfigMap",
                                     "metadata": {"name": "chat", "namespace": NS},
                                     "data": {"app.yaml": "x: 1"}}, "application/json")
    with run_operator():
        await api.call("POST", LLMD_PATH, _body(), "application/json")
        await eventually(lambda: _observed(api, 1), what="first reconcile")
        await settle(kube)
        quiet = await api.get_or_none(f"{LLMD_PATH}/chat")
        dep = await api.get_or_none(f"{DEP_PATH}/chat")
        await api.call("PATCH", f"{LLMD_PATH}/chat",
                       {"spec": {"runtime": {"loraAdapters": [SQL]}}})
        degraded = await wait_for_degraded(api, "ChildConflict")
        await settle(kube)

    conds = {c["type"]: c for c in quiet["status"]["conditions"]}
    assert conds["Degraded"]["status"] == "False"
    assert "ConfigMap chat exists and is not managed by argosy-operator" in degraded["message"]
    assert _writes(list(kube), f"{CM_PATH}/chat") == []  # neither deleted nor patched
    cm = await api.get_or_none(f"{CM_PATH}/chat")
    assert cm["data"] == {"app.yaml": "x: 1"} and "ownerReferences" not in cm["metadata"]
    # The Deployment never got a mount of someone else's ConfigMap.
    after = await api.get_or_none(f"{DEP_PATH}/chat")
    assert after["spec"]["template"] == dep["spec"]["template"]
