"""Review fixes in reconciliation and the builders: fields dropped from list items (the
containers, the volumes) are removed from the live Deployment, pod-template volumes that
clash with the operator's are refused naming the field, and a model download that succeeded
after a failed attempt is not reported as a problem."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from argosy_operator.builders import build_deployment
from argosy_operator.kube import DEPLOYMENTS, LLMDEPLOYMENTS, KubeClient
from argosy_operator.pod_problems import pod_problems
from argosy_operator.reconcile import reconcile
from argosy_operator.spec import InvalidSpecError, normalize_spec
from operator_helpers import NS


def _llmd(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"name": "smollm2", "path": "smollm2-135m"}}
    body.update(spec)
    return {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "chat", "namespace": NS}, "spec": body}


@pytest.fixture
async def client(kube: Any) -> AsyncIterator[KubeClient]:
    c = KubeClient(str(kube.url), headers={"Authorization": "Bearer t"})
    yield c
    await c.close()


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def _model_volume(dep: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")


HF = {"name": "smollm2", "source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}


@pytest.mark.parametrize(("before", "after", "check"), [
    ({"resources": {"cpu": "2", "memory": "4Gi"}}, {},
     lambda d: _container(d)["resources"] == {}),
    ({"runtime": {"preStopSleepSeconds": 5}}, {"runtime": {"preStopSleepSeconds": 0}},
     lambda d: "lifecycle" not in _container(d)),
    ({"model": {**HF, "cacheSizeLimit": "20Gi"}}, {"model": HF},
     lambda d: _model_volume(d)["emptyDir"] == {}
     and "ephemeral-storage" not in _container(d).get("resources", {}).get("requests", {})),
], ids=["cpu-and-memory", "prestop-hook", "cache-size-limit"])
async def test_a_field_dropped_from_a_list_item_is_removed_from_the_deployment(
        client: KubeClient, before: dict[str, Any], after: dict[str, Any],
        check: Callable[[dict[str, Any]], bool]) -> None:
    """Containers and volumes are lists: the live items carry the API server's defaults, so
    the patch let any extra key stand, also one the operator had set and no longer wants.
    Removing spec.resources.cpu left the CPU request on the pods forever."""
    obj = await client.create(LLMDEPLOYMENTS, NS, _llmd(**before))
    await reconcile(client, obj)
    obj["spec"] = _llmd(**after)["spec"]
    await reconcile(client, obj)
    dep = await client.get(DEPLOYMENTS, NS, "chat")
    assert check(dep), dep["spec"]["template"]["spec"]


async def test_an_unchanged_spec_sends_no_patch_over_defaulted_list_items(
        kube: Any, client: KubeClient) -> None:
    """The list comparison with the last-applied record must not resend a list that only
    gained the API server's defaults (each resend would be a write per reconcile)."""
    obj = await client.create(LLMDEPLOYMENTS, NS, _llmd(resources={"cpu": "2"}))
    await reconcile(client, obj)
    live = await client.get(DEPLOYMENTS, NS, "chat")
    containers = copy.deepcopy(live["spec"]["template"]["spec"]["containers"])
    containers[0]["terminationMessagePath"] = "/dev/termination-log"  # an API server default
    await client.patch(DEPLOYMENTS, NS, "chat",
                       {"spec": {"template": {"spec": {"containers": containers}}}})
    patches = len([r for r in list(kube) if r.method == "PATCH"])
    result = await reconcile(client, obj)
    assert result.actions == []
    assert len([r for r in list(kube) if r.method == "PATCH"]) == patches


@pytest.mark.parametrize(("template", "field"), [
    ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.podTemplate.volumes"),
    ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]},
     "spec.podTemplate.volumes"),
    ({"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
      "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]},
     "spec.podTemplate.volumeMounts"),
    ({"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
     "spec.podTemplate.volumeMounts: name 'data' is no volume"),
])
def test_a_pod_template_volume_that_clashes_with_the_operators_is_an_invalid_spec(
        template: dict[str, Any], field: str) -> None:
    """The API server refuses such a Deployment (422 Duplicate value): that was ApplyFailed,
    retried forever and never Stalled; it is a spec error, named as such."""
    llmd = _llmd(resources={"gpus": 1}, podTemplate=template)
    llmd["metadata"]["uid"] = "u-1"
    with pytest.raises(InvalidSpecError, match=field):
        build_deployment(llmd, normalize_spec(llmd["spec"]), 1)


def test_a_pod_template_volume_of_its_own_name_and_path_is_fine() -> None:
    """Also a second mount of one of the operator's volumes, at another path."""
    llmd = _llmd(podTemplate={"volumes": [{"name": "data", "emptyDir": {}}],
                              "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                               {"name": "tmp", "mountPath": "/scratch"}]})
    llmd["metadata"]["uid"] = "u-1"
    dep = build_deployment(llmd, normalize_spec(llmd["spec"]), 1)
    assert _container(dep)["volumeMounts"][-2:] == [{"name": "data", "mountPath": "/data"},
                                                    {"name": "tmp", "mountPath": "/scratch"}]


def test_a_download_that_succeeded_after_a_failed_attempt_is_no_problem() -> None:
    """An init container keeps its failed attempt in lastState for the pod's lifetime; once
    it completed, the pod is fine (it was reported ModelDownloadFailed while serving)."""
    pod = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [{
        "name": "model-download",
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                     "message": "connection reset"}}}]}}
    assert pod_problems([pod]) == []
    # Still failing (retrying after the failure): reported.
    running = copy.deepcopy(pod)
    running["status"]["initContainerStatuses"][0]["state"] = {"waiting": {
        "reason": "CrashLoopBackOff"}}
    assert [p.reason for p in pod_problems([running])] == ["ModelDownloadFailed"]


@pytest.mark.parametrize(("extra_args", "grace"), [
    ([], 5 + 30 + 15),
    (["--drain-timeout", "300"], 5 + 300 + 15),
    (["--drain-timeout=120.5", "--max-waiting", "8"], 5 + 121 + 15),
    (["--drain", "90"], 5 + 90 + 15),  # argparse's abbreviation
    (["--drain-timeout", "300", "--drain-timeout", "60"], 5 + 60 + 15),  # the last one wins
])
def test_the_grace_period_covers_a_drain_timeout_given_in_extra_args(
        extra_args: list[str], grace: int) -> None:
    """extraArgs come last on the command line, so their `--drain-timeout` is the one the
    server drains for; the grace period followed only runtime.drainTimeoutSeconds, and the
    kubelet killed a server draining longer mid-request."""
    llmd = _llmd(runtime={"extraArgs": extra_args})
    llmd["metadata"]["uid"] = "u-1"
    dep = build_deployment(llmd, normalize_spec(llmd["spec"]), 1)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
