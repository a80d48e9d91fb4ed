"""Three-way merge patches, condition merging, pod problems and the computed status."""

from __future__ import annotations

from typing import Any

import pytest
from argosy_operator.conditions import condition, merge_conditions
from argosy_operator.kube import LLMDEPLOYMENTS, ApiError
from argosy_operator.merge_patch import holds, three_way_merge_patch
from argosy_operator.pod_problems import pod_problems
from argosy_operator.status import compute_status, refresh_status, status_patch

# --- merge patches ---------------------------------------------------------------------------


def test_patch_is_empty_when_live_holds_desired_plus_server_defaults() -> None:
    desired = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    live = {"spec": {"replicas": 3, "template": {"spec": {
        "containers": [{"name": "c", "image": "i", "terminationMessagePath": "/dev/x"}],
        "dnsPolicy": "ClusterFirst"}}}, "status": {"replicas": 3}}
    assert three_way_merge_patch(desired, desired, live) == {}


def test_changed_list_is_sent_whole_and_scalars_alone() -> None:
    last = {"spec": {"a": 1, "list": [{"name": "c", "image": "old"}], "b": "keep"}}
    desired = {"spec": {"a": 2, "list": [{"name": "c", "image": "new"}], "b": "keep"}}
    live = {"spec": {"a": 1, "list": [{"name": "c", "image": "old", "x": 1}], "b": "keep"}}
    assert three_way_merge_patch(last, desired, live) == {
        "spec": {"a": 2, "list": [{"name": "c", "image": "new"}]}}


def test_a_key_dropped_from_a_list_item_sends_the_list_whole() -> None:
    # The live list still "holds" the new one (the dropped key looks like a server default),
    # but the last-applied record says the key was the operator's: only a whole list removes it.
    last = {"spec": {"c": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}}
    desired = {"spec": {"c": [{"name": "c", "resources": {}}]}}
    live = {"spec": {"c": [{"name": "c", "resources": {"requests": {"cpu": "1"}},
                            "imagePullPolicy": "Always"}]}}
    assert three_way_merge_patch(last, desired, live) == desired
    assert three_way_merge_patch(desired, desired, live) == {}  # unchanged since: no patch


def test_fields_dropped_from_desired_are_nulled_but_foreign_fields_stay() -> None:
    last = {"metadata": {"labels": {"mine": "1", "gone": "1"}}, "spec": {"opt": True}}
    desired = {"metadata": {"labels": {"mine": "1"}}, "spec": {}}
    live = {"metadata": {"labels": {"mine": "1", "gone": "1", "theirs": "x"}},
            "spec": {"opt": True, "replicas": 7}}
    assert three_way_merge_patch(last, desired, live) == {
        "metadata": {"labels": {"gone": None}}, "spec": {"opt": None}}


def test_drift_on_an_owned_field_is_corrected() -> None:
    desired = {"spec": {"type": "ClusterIP"}}
    assert three_way_merge_patch(desired, desired, {"spec": {"type": "NodePort"}}) == desired


def test_booleans_are_not_integers() -> None:
    assert not holds(1, True) and not holds(True, 1) and holds(False, False)


# --- conditions ------------------------------------------------------------------------------


def test_transition_time_moves_only_when_status_flips() -> None:
    first = merge_conditions([], [condition("Ready", False, "NoReplicasReady", "0/1")], "T1")
    same = merge_conditions(first, [condition("Ready", False, "NoReplicasReady", "0/1")], "T2")
    assert same == first
    reworded = merge_conditions(first, [condition("Ready", False, "ImagePullFailure", "x")],
                                "T3")
    assert reworded[0]["lastTransitionTime"] == "T1" and reworded[0]["reason"] == \
        "ImagePullFailure"
    flipped = merge_conditions(reworded, [condition("Ready", True, "AllReplicasReady", "1/1")],
                               "T4")
    assert flipped[0]["lastTransitionTime"] == "T4" and flipped[0]["status"] == "True"


def test_other_writers_conditions_are_kept_in_place() -> None:
    existing = [{"type": "ScalingActive", "status": "True", "reason": "Metrics",
                 "message": "ok", "lastTransitionTime": "T0"},
                {"type": "Ready", "status": "False", "reason": "R", "message": "m",
                 "lastTransitionTime": "T0"}]
    merged = merge_conditions(existing, [condition("Ready", True, "AllReplicasReady", "1/1"),
                                         condition("Degraded", False, "AsExpected", "")], "T1")
    assert [c["type"] for c in merged] == ["ScalingActive", "Ready", "Degraded"]
    assert merged[0] == existing[0]


# --- pod problems ----------------------------------------------------------------------------


def _pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def test_pod_problems_most_actionable_first() -> None:
    pods = [
        _pod("a", containerStatuses=[{"name": "runtime", "state": {"waiting": {
            "reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
            "lastState": {"terminated": {"exitCode": 1}}}]),
        _pod("b", conditions=[{"type": "PodScheduled", "status": "False",
                               "reason": "Unschedulable",
                               "message": "0/2 nodes: 2 Insufficient nvidia.com/gpu"}]),
        _pod("c", containerStatuses=[{"name": "runtime", "state": {"waiting": {
            "reason": "ErrImagePull", "message": "manifest unknown"}}}]),
        _pod("d", containerStatuses=[{"name": "runtime", "state": {"running": {}},
                                      "lastState": {"terminated": {"reason": "OOMKilled",
                                                                   "exitCode": 137}}}]),
        _pod("e", initContainerStatuses=[{"name": "model-download", "state": {"waiting": {
            "reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {
                "exitCode": 1, "message": "401 Unauthorized"}}}]),
        {"metadata": {"name": "f", "deletionTimestamp": "T"}, "status": {
            "containerStatuses": [{"name": "runtime", "state": {"waiting": {
                "reason": "ErrImagePull"}}}]}},
    ]
    problems = pod_problems(pods)
    assert [(p.reason, p.pod) for p in problems] == [
        ("ImagePullFailure", "c"), ("Unschedulable", "b"), ("ModelDownloadFailed", "e"),
        ("OOMKilled", "d"), ("CrashLoopBackOff", "a")]
    assert "manifest unknown" in problems[0].message
    assert "401 Unauthorized" in problems[2].message
    assert "spec.resources.memory" in problems[3].message


def test_healthy_pods_have_no_problems() -> None:
    assert pod_problems([_pod("a", phase="Running", containerStatuses=[
        {"name": "runtime", "ready": True, "state": {"running": {}}}])]) == []


def test_an_oom_kill_the_ready_container_recovered_from_is_no_problem() -> None:
    # lastState keeps the kill as long as the pod lives: Degraded until it was replaced.
    oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    assert pod_problems([_pod("a", containerStatuses=[
        {"name": "runtime", "ready": True, "restartCount": 1, "state": {"running": {}},
         "lastState": oom}])]) == []


# --- computed status -------------------------------------------------------------------------

LLMD = {"metadata": {"name": "chat", "namespace": "ml", "generation": 4},
        "spec": {"model": {"name": "smol", "path": "smollm2-135m"}, "replicas": 2}}


def _dep(replicas: int = 2, ready: int = 0, updated: int = 0, total: int = 0,
         generation: int = 1, observed: int = 1, conditions: list | None = None
         ) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": total,
                       "readyReplicas": ready, "updatedReplicas": updated,
                       "conditions": conditions or []}}


def _conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize("dep,pods,expected", [
    (_dep(ready=2, updated=2, total=2), [],
     {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
      "Degraded": ("False", "AsExpected")}),
    (_dep(ready=1, updated=1, total=2, generation=2, observed=2), [],
     {"Ready": ("True", "PartiallyReady"), "Progressing": ("True", "RollingUpdate"),
      "Degraded": ("False", "AsExpected")}),
    (_dep(ready=2, updated=2, total=2, generation=3, observed=2), [],
     {"Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "RollingUpdate"),
      "Degraded": ("False", "AsExpected")}),
    (_dep(replicas=1, ready=1, updated=1, total=2), [],
     {"Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "ScalingDown"),
      "Degraded": ("False", "AsExpected")}),
    (_dep(replicas=0), [],
     {"Ready": ("False", "ScaledToZero"), "Progressing": ("False", "RolloutComplete"),
      "Degraded": ("False", "AsExpected")}),
    (_dep(total=1, updated=1, conditions=[{"type": "Progressing", "status": "False",
                                           "reason": "ProgressDeadlineExceeded",
                                           "message": "took too long"}]), [],
     {"Ready": ("False", "NoReplicasReady"),
      "Progressing": ("False", "ProgressDeadlineExceeded"),
      "Degraded": ("True", "ProgressDeadlineExceeded")}),
    (_dep(conditions=[{"type": "ReplicaFailure", "status": "True",
                       "message": "exceeded quota: gpu"}]), [],
     {"Ready": ("False", "NoReplicasReady"), "Progressing": ("True", "RollingUpdate"),
      "Degraded": ("True", "ReplicaFailure")}),
    (_dep(total=2, updated=2), [_pod("p", containerStatuses=[{"name": "runtime", "state": {
        "waiting": {"reason": "ImagePullBackOff"}}}])],
     {"Ready": ("False", "ImagePullFailure"), "Progressing": ("True", "WaitingForReplicas"),
      "Degraded": ("True", "ImagePullFailure")}),
])
def test_compute_status_conditions(dep: dict[str, Any], pods: list[dict[str, Any]],
                                   expected: dict[str, tuple[str, str]]) -> None:
    status = compute_status(LLMD, dep, pods, observed_generation=4)
    assert _conds(status) == expected
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])
    assert status["selector"] == "argosy.dev/llmdeployment=chat"
    assert status["endpoint"] == "http://chat.ml.svc:8000/v1"
    assert status["model"] == "smol"


def test_status_patch_is_none_when_nothing_changed() -> None:
    computed = compute_status(LLMD, _dep(ready=2, updated=2, total=2), [], 4)
    first = status_patch({}, computed, "T1")
    assert first is not None and first["conditions"][0]["lastTransitionTime"] == "T1"
    current = dict(first)
    again = compute_status(LLMD, _dep(ready=2, updated=2, total=2), [], 4)
    assert status_patch(current, again, "T2") is None
    # The autoscaler's fields are never part of the reconciler's patch.
    current.update(desiredReplicas=3, kvCachePercent=55)
    assert status_patch(current, again, "T3") is None
    fewer = compute_status(LLMD, _dep(ready=1, updated=2, total=2), [], 4)
    patch = status_patch(current, fewer, "T4")
    assert patch is not None and patch["readyReplicas"] == 1
    assert set(patch) == {"readyReplicas", "conditions"}


def test_an_unchanged_autoscaling_decision_writes_no_status_again() -> None:
    """The autoscaler's status holds nested nulls (limitedBy, the ratios without data), which
    the API server's merge patch drops: the stored status must still count as unchanged, or
    every tick (each scrapeIntervalSeconds, per LLMDeployment) sends the same status again."""
    from argosy_operator.autoscaling.decision import DecisionState, decide
    from argosy_operator.autoscaling.policy import AutoscalingPolicy
    from argosy_operator.autoscaling.status import autoscaling_status
    from kmock._internal.dicts import merge_patch_dict  # RFC 7386, as the API server applies

    decision = decide(AutoscalingPolicy(enabled=True), 1, [], DecisionState(), 10.0)
    computed = autoscaling_status(decision, None)
    assert computed["autoscaling"]["limitedBy"] is None
    first = status_patch({}, computed, "T1")
    assert first is not None
    stored = merge_patch_dict({}, first)
    assert "limitedBy" not in stored["autoscaling"]
    assert status_patch(stored, autoscaling_status(decision, None), "T2") is None
    # A field that goes away is still deleted (its null is sent).
    stored["autoscaling"]["limitedBy"] = "MaxReplicas"
    patch = status_patch(stored, autoscaling_status(decision, None), "T3")
    assert patch is not None and patch["autoscaling"]["limitedBy"] is None


# --- writing the status under concurrency ----------------------------------------------------


class _RacingClient:
    """A client whose first status write loses a race: another writer bumped the object and
    the unschedulable pod went away in between (what a real API server answers with 409)."""

    def __init__(self) -> None:
        self.pod_lists: list[list[dict[str, Any]]] = [
            [_pod("chat-b", phase="Pending", conditions=[{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes: 3 Insufficient nvidia.com/gpu"}])],
            [],
        ]
        self.writes: list[dict[str, Any]] = []

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any] | None:
        if resource == LLMDEPLOYMENTS:  # the re-read after the conflict
            return {**LLMD, "metadata": {**LLMD["metadata"], "resourceVersion": "8"},
                    "status": {"observedGeneration": 4}}
        return _dep(ready=2, updated=2, total=2)

    async def list(self, resource: Any, namespace: str, label_selector: str = "") -> list:
        return self.pod_lists.pop(0)

    async def patch(self, resource: Any, namespace: str, name: str, body: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] == "7":
            raise ApiError(409, "Conflict", "the object has been modified")
        self.writes.append(body["status"])
        return body


async def test_a_retry_after_a_conflict_reads_the_pods_again() -> None:
    client = _RacingClient()
    llmd = {**LLMD, "metadata": {**LLMD["metadata"], "resourceVersion": "7"}, "status": {}}
    patch, base = await refresh_status(client, llmd)  # type: ignore[arg-type]
    assert base["metadata"]["resourceVersion"] == "8"
    assert client.writes == [patch]
    degraded = next(c for c in patch["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"  # not Unschedulable from the pod list read before
