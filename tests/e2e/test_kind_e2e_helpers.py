"""The kind suite's pieces that run without a cluster: what it applies and how it judges.

The LLMDeployment it applies (the CPU sample with the e2e overrides) must be valid for the CRD,
for the operator's own spec handling and autoscaling policy, and build into a Deployment that
Kubernetes' schema accepts; the owner-chain walk that decides "nothing left" must follow
Deployment -> ReplicaSet -> Pod; the pinned kind node and CI workflow must agree.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "llmdeployments.argosy.dev.yaml"
WORKFLOW = REPO / ".github" / "workflows" / "e2e-kind.yml"


def _load_scenario() -> ModuleType:
    name = "argosy_kind_e2e"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "e2e" / "kind" / "kind_e2e.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


scenario = _load_scenario()


def _obj(kind: str, name: str, uid: str, owner: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if owner is not None:
        meta["ownerReferences"] = [{"uid": owner, "kind": "X", "name": "x"}]
    return {"kind": kind, "metadata": meta}


def test_owned_by_follows_the_owner_chain_in_any_order() -> None:
    objects = [
        _obj("Pod", "p1", "u-pod1", owner="u-rs"),
        _obj("Pod", "other", "u-pod9", owner="u-rs-other"),
        _obj("ReplicaSet", "rs", "u-rs", owner="u-dep"),
        _obj("Service", "svc", "u-svc", owner="u-llmd"),
        _obj("Deployment", "dep", "u-dep", owner="u-llmd"),
        _obj("ConfigMap", "unrelated", "u-cm"),
    ]
    owned = scenario.owned_by(objects, {"u-llmd"})
    assert sorted(o["metadata"]["name"] for o in owned) == ["dep", "p1", "rs", "svc"]
    assert scenario.owned_by(objects, {"u-nobody"}) == []


def test_parse_forwarded_port_reads_kubectl_output() -> None:
    assert scenario.parse_forwarded_port("Forwarding from 127.0.0.1:40517 -> 8000\n") == 40517
    assert scenario.parse_forwarded_port("Forwarding from [::1]:40517 -> 8000\n") is None
    assert scenario.parse_forwarded_port("Handling connection for 40517\n") is None


def test_deep_merge_replaces_leaves_and_keeps_siblings() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 4}
    merged = scenario.deep_merge(base, {"a": {"c": [3]}, "e": 5})
    assert merged == {"a": {"b": 1, "c": [3]}, "d": 4, "e": 5}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 4}  # not modified


@pytest.fixture(scope="module")
def e2e_resource() -> dict[str, Any]:
    if not (REPO / "manifests" / "samples").is_dir():
        pytest.skip("manifests/samples not written yet (operator issue)")
    return scenario.e2e_deployment(scenario.find_cpu_sample())


def test_the_cpu_sample_is_the_one_deployed(e2e_resource: dict[str, Any]) -> None:
    assert e2e_resource["kind"] == "LLMDeployment"
    assert (e2e_resource["spec"].get("resources") or {}).get("gpus", 0) == 0
    assert e2e_resource["metadata"]["namespace"] == scenario.E2E_NAMESPACE
    assert e2e_resource["spec"]["runtime"]["image"] == (
        "ghcr.io/argosy-project/argosy-runtime-cpu:0.1.0")


def test_e2e_resource_is_valid_for_the_crd_schema(e2e_resource: dict[str, Any]) -> None:
    if not CRD.exists():
        pytest.skip("crds/llmdeployments.argosy.dev.yaml not written yet (operator issue)")
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    # OpenAPI v3.0 schemas use draft-4 keywords (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(schema).validate(e2e_resource)
    # The same validator rejects a policy the overrides must never produce.
    bad = scenario.deep_merge(e2e_resource, {"spec": {"autoscaling": {"targetQueueDepth": 0}}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(bad)


def test_e2e_resource_builds_a_valid_deployment_with_an_eager_policy(
        e2e_resource: dict[str, Any]) -> None:
    from argosy_operator.autoscaling.policy import AutoscalingPolicy
    from argosy_operator.builders.deployment import build_deployment
    from argosy_operator.spec import normalize_spec

    spec = normalize_spec(e2e_resource["spec"])
    policy = AutoscalingPolicy.from_spec(spec["autoscaling"])
    assert policy.enabled and policy.min_replicas == 1 and policy.max_replicas >= 2
    llmd = {**e2e_resource, "metadata": {**e2e_resource["metadata"], "uid": "u-1"}}
    deployment = build_deployment(llmd, spec, replicas=1)
    kubernetes_validate.validate(deployment, scenario.kind_node_version(), strict=True)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/argosy-project/argosy-runtime-cpu:0.1.0"
    args = " ".join(container["args"])
    assert "--max-num-seqs 2" in args and "--kv-cache-memory" in args
    # Two replicas' requests fit a hosted runner (4 CPUs, 16 GiB), with room for the operator.
    requests = container["resources"]["requests"]
    assert float(requests["cpu"].rstrip("m")) / (1000 if requests["cpu"].endswith("m") else 1) <= 1
    assert requests["memory"] in ("1Gi", "2Gi")


def test_kind_node_image_is_pinned_and_documented() -> None:
    config = yaml.safe_load(scenario.KIND_CONFIG.read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    image = config["nodes"][0]["image"]
    assert re.fullmatch(r"kindest/node:v\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", image)
    assert image.split("@")[1] in (REPO / "docs" / "deploy.md").read_text()
    assert scenario.kind_node_version() == re.search(r":v(\d+\.\d+)", image).group(1)


def test_workflow_installs_the_kind_release_that_lists_the_node_image() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    kind_version = workflow["env"]["KIND_VERSION"]
    assert f"kind {kind_version}" in scenario.KIND_CONFIG.read_text()
    assert workflow["permissions"] == {"contents": "read"}
    steps = [s.get("run", "") for s in workflow["jobs"]["e2e-kind"]["steps"]]
    assert any(s.startswith("make e2e-kind") for s in steps)
    assert any("download.pytorch.org/whl/cpu" in s for s in steps)


def test_make_targets_build_the_four_images_and_run_the_script() -> None:
    images = subprocess.run(["make", "-n", "images"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    # One docker build per image, each from its Dockerfile, tagged with the contract's name.
    assert "for name in runtime-cpu runtime-cuda operator gateway" in images
    assert "docker build -f docker/$name.Dockerfile " in images
    assert "-t ghcr.io/argosy-project/argosy-$name:0.1.0 ." in images
    e2e = subprocess.run(["make", "-n", "e2e-kind"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "e2e/kind/kind_e2e.py" in e2e


def test_script_refuses_to_run_without_docker_and_kind() -> None:
    reason = scenario.preflight()
    if reason is None:
        pytest.skip("docker and kind are available here")
    proc = subprocess.run([sys.executable, str(REPO / "e2e" / "kind" / "kind_e2e.py")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "cannot run" in proc.stdout
