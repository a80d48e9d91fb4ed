"""Drift detection on a child's watch event (argosy_operator.drift), without a cluster."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from argosy_operator import drift
from argosy_operator.constants import ANNOTATION_LAST_APPLIED
from argosy_operator.reconcile import last_applied_record, with_last_applied


@pytest.fixture(autouse=True)
def _fresh_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(drift, "_applied", {})
    yield


def _deployment(replicas: int | None = 2, cpu: str = "2") -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": {"argosy.dev/llmdeployment": "chat"}},
                            "template": {"spec": {"containers": [{
                                "name": "runtime", "image": "argosy:1",
                                "resources": {"requests": {"cpu": cpu}}}]}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "chat", "namespace": "ml",
                         "labels": {"app.kubernetes.io/managed-by": "argosy-operator"}},
            "spec": spec}


def _stored(desired: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """`desired` as the API server stores it after the operator's create: a uid, defaults
    and a status the operator never wrote (and `spec` overrides)."""
    live = with_last_applied(desired)
    live["metadata"].update(uid="u-1", resourceVersion="7", generation=1)
    live["spec"].update(spec)
    container = live["spec"]["template"]["spec"]["containers"][0]
    container["terminationMessagePath"] = "/dev/termination-log"  # an API server default
    live["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 0}
    return live


def test_the_operators_own_write_and_status_updates_are_no_drift() -> None:
    live = _stored(_deployment())
    assert drift.drifted(live) is None  # before it is remembered too: it holds its record
    drift.remember(live, replicas=2)
    live["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2}
    live["metadata"]["resourceVersion"] = "8"
    assert drift.drifted(live) is None


@pytest.mark.parametrize(("edit", "field"), [
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].update(image="other:2"),
     "spec.template.spec.containers"),
    (lambda o: o["metadata"]["labels"].pop("app.kubernetes.io/managed-by"),
     "metadata.labels.app.kubernetes.io/managed-by"),
    (lambda o: o["spec"].pop("selector"), "spec.selector"),
    (lambda o: o["metadata"]["annotations"].pop(ANNOTATION_LAST_APPLIED),
     f"metadata.annotations.{ANNOTATION_LAST_APPLIED}"),
    (lambda o: o["metadata"]["annotations"].update({ANNOTATION_LAST_APPLIED: "{not json"}),
     f"metadata.annotations.{ANNOTATION_LAST_APPLIED}"),
])
def test_an_edit_of_a_managed_field_is_drift(edit: Any, field: str) -> None:
    live = _stored(_deployment())
    drift.remember(live, replicas=2)
    edit(live)
    assert drift.drifted(live) == field


def test_fields_others_add_are_no_drift() -> None:
    live = _stored(_deployment())
    drift.remember(live, replicas=2)
    # `kubectl rollout restart`, another controller's label, a pod template annotation.
    live["metadata"]["labels"]["team"] = "search"
    live["spec"]["template"]["metadata"] = {"annotations": {
        "kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z"}}
    assert drift.drifted(live) is None


def test_replicas_are_drift_only_where_the_operator_keeps_them() -> None:
    kept = _stored(_deployment(replicas=2))
    drift.remember(kept, replicas=2)
    kept["spec"]["replicas"] = 5
    assert drift.drifted(kept) == "spec.replicas"
    # Autoscaling on: the operator applied no count to keep (the record never holds one).
    scaled = _stored(_deployment(replicas=2))
    scaled["metadata"]["uid"] = "u-2"
    drift.remember(scaled, replicas=None)
    scaled["spec"]["replicas"] = 5
    assert drift.drifted(scaled) is None
    assert "replicas" not in json.loads(
        scaled["metadata"]["annotations"][ANNOTATION_LAST_APPLIED])["spec"]


def test_the_api_servers_own_spelling_is_no_drift_once_remembered() -> None:
    """cpu "0.5" sent, "500m" stored: not holding the record, yet as the operator left it."""
    live = _stored(_deployment(cpu="0.5"))
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "500m"
    assert drift.drifted(live) == "spec.template.spec.containers"  # unknown: reapply once
    drift.remember(live)
    assert drift.drifted(live) is None
    live["status"] = {"readyReplicas": 2}
    assert drift.drifted(live) is None
    edited = copy.deepcopy(live)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "other:2"
    assert drift.drifted(edited) == "spec.template.spec.containers"
    drift.forget(live)
    assert drift.drifted(live) == "spec.template.spec.containers"


def test_a_child_being_deleted_is_no_drift() -> None:
    live = _stored(_deployment())
    live["metadata"]["labels"].clear()
    live["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert drift.drifted(live) is None


def test_the_record_left_out_of_the_digest_is_the_one_reconcile_writes() -> None:
    desired = _deployment()
    assert drift.last_applied(with_last_applied(desired)) == last_applied_record(desired)


async def test_an_event_of_a_write_in_flight_waits_for_that_reconcile() -> None:
    """The watch may deliver the operator's own patch (replicas 2 -> 3) before the patch's
    response, i.e. before the reconcile remembers it: the handler looks again once the
    owner's reconcile is done, and reapplies nothing."""
    from argosy_operator import handlers

    before = _stored(_deployment(replicas=2))
    drift.remember(before, replicas=2)
    after = copy.deepcopy(before)
    after["spec"]["replicas"] = 3
    lock = handlers._reconcile_lock("ml", "chat")
    async with lock:  # the spec change's reconcile, mid-write
        check = asyncio.create_task(handlers._reapply_reason(
            {"type": "MODIFIED", "object": after}, after, "ml", "chat"))
        await asyncio.sleep(0.05)
        assert not check.done()
        drift.remember(after, replicas=3)
    assert await check is None
    # A hand edit after that write is drift.
    edited = copy.deepcopy(after)
    edited["spec"]["replicas"] = 1
    reason = await handlers._reapply_reason({"type": "MODIFIED", "object": edited}, edited,
                                            "ml", "chat")
    assert reason is not None and "spec.replicas" in reason
