"""How failures show in the status: a refused spec as a terminal failure (as kstatus, and the
GitOps tools built on it, read one), a spec from an older CRD, and API errors on the status
writes (retried, one log line each)."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from argosy_operator.kube import ApiError
from operator_helpers import NS, Api
from test_operator_handlers import (
    DEP_PATH,
    LLMD_PATH,
    _cond,
    _status,
    llmd,
    reconciled_by_the_handlers,
)


def kstatus(obj: dict[str, Any]) -> str:
    """kstatus' verdict for a custom resource (cli-utils pkg/kstatus, checkGenericProperties):
    an unobserved generation is in progress; then Reconciling=True is in progress and
    Stalled=True failed; else current."""
    status = obj.get("status") or {}
    if status.get("observedGeneration", obj["metadata"]["generation"]) \
            != obj["metadata"]["generation"]:
        return "InProgress"
    for cond in status.get("conditions") or []:
        if cond["type"] == "Reconciling" and cond["status"] == "True":
            return "InProgress"
        if cond["type"] == "Stalled" and cond["status"] == "True":
            return "Failed"
    return "Current"


async def _reconcile(api: Api, retry: int = 0) -> None:
    from argosy_operator import handlers

    body = await api.call("GET", f"{LLMD_PATH}/chat")
    await handlers.reconcile_llmdeployment(body=body, meta=body["metadata"],
                                           logger=logging.getLogger("test"), retry=retry)


async def test_an_invalid_edit_is_a_terminal_failure_and_the_running_children_stay(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit the operator refuses (admitted by an older CRD): observedGeneration is the new
    generation, Ready and Progressing are False and Degraded and Stalled True (InvalidSpec,
    of that generation), so kstatus says Failed rather than in progress until a timeout. The
    children of the last applied spec are left running; pod events update the counts but not
    the verdict; a fixed spec clears it."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)) as events:
        before = await api.call("GET", f"{DEP_PATH}/chat")
        kube.crd_validation = False
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "replicas": 3, "monitoring": {"interval": "1s1m"}}})
        with pytest.raises(kopf.PermanentError, match="spec.monitoring.interval"):
            await _reconcile(api)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert obj["metadata"]["generation"] == 2
        assert obj["status"]["observedGeneration"] == 2
        for type_, status in (("Ready", "False"), ("Progressing", "False"),
                              ("Degraded", "True"), ("Stalled", "True")):
            cond = _cond(obj["status"], type_)
            assert (cond["status"], cond["reason"], cond["observedGeneration"]) == (
                status, "InvalidSpec", 2), cond
            assert "spec.monitoring.interval" in cond["message"]
        assert kstatus(obj) == "Failed"
        assert [e["reason"] for e in events if e["type"] == "Warning"] == ["InvalidSpec"]
        # The Deployment of generation 1 is untouched (not scaled to 3, not deleted).
        after = await api.call("GET", f"{DEP_PATH}/chat")
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        assert after["spec"]["replicas"] == 2

        # Its pods become ready: the counts follow, the verdict stays.
        await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
            "observedGeneration": after["metadata"]["generation"], "replicas": 2,
            "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2}})
        await handlers.pod_changed(meta={"labels": {"argosy.dev/llmdeployment": "chat"}},
                                   namespace=NS)
        status = await _status(api)
        assert status["readyReplicas"] == 2 and status["observedGeneration"] == 2
        assert _cond(status, "Ready")["reason"] == "InvalidSpec"
        assert _cond(status, "Stalled")["status"] == "True"

        # The spec fixed: applied, no longer stalled.
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "monitoring": {"interval": "30s"}}})
        await _reconcile(api)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert obj["status"]["observedGeneration"] == 3
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 3
        stalled = _cond(obj["status"], "Stalled")
        assert (stalled["status"], stalled["observedGeneration"]) == ("False", 3)
        assert _cond(obj["status"], "Degraded")["status"] == "False"
        assert _cond(obj["status"], "Ready")["reason"] != "InvalidSpec"
        assert kstatus(obj) == "Current"


def test_the_status_of_a_spec_without_model_name_is_computed() -> None:
    """An object admitted under an older CRD without spec.model.name: its pod events refresh
    the status (a KeyError here failed every one of them). The other spec read of a status
    refresh, whether autoscaling is on, takes a null object too."""
    from argosy_operator.spec import autoscaling_enabled
    from argosy_operator.status import compute_status

    obj = llmd(model={"path": "smollm2-135m"})
    obj["metadata"]["uid"] = "u1"
    deployment = {"metadata": {"generation": 1}, "spec": {"replicas": 1},
                  "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1,
                             "updatedReplicas": 1}}
    status = compute_status(obj, deployment, [], 1)
    assert status["readyReplicas"] == 1 and status["model"] is None
    assert compute_status(llmd(model=None), None, [], 1)["model"] is None
    assert autoscaling_enabled({"autoscaling": None}) is False


def _fail_status_writes(monkeypatch: pytest.MonkeyPatch, errors: list[Exception]) -> None:
    """The operator's client fails its next status writes with `errors` (then succeeds)."""
    from argosy_operator import handlers

    client = handlers._state["client"]
    patch = client.patch

    async def flaky(res: Any, namespace: str, name: str, body: Any,
                    subresource: str | None = None) -> Any:
        if subresource == "status" and errors:
            raise errors.pop(0)
        return await patch(res, namespace, name, body, subresource=subresource)

    monkeypatch.setattr(client, "patch", flaky)


async def test_a_failed_status_refresh_is_retried_and_logged_in_one_line(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A pod event's status write that the API server fails (5xx, no answer in time, a
    conflict outlasting the re-reads): kopf does not retry event handlers and only the next
    event of that pod would write the status, so the handler retries itself; each failure is
    one warning, not a traceback."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
            "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}})
        _fail_status_writes(monkeypatch, [
            ApiError(503, "ServiceUnavailable", "etcd leader changed"), TimeoutError(),
            *[ApiError(409, "Conflict", "the object has been modified")] * 4])
        with caplog.at_level(logging.WARNING, logger="argosy.operator"):
            await handlers.pod_changed(meta={"labels": {"argosy.dev/llmdeployment": "chat"}},
                                       namespace=NS)
    assert (await _status(api))["readyReplicas"] == 2
    lines = [r for r in caplog.records if r.name == "argosy.operator"]
    assert [r.getMessage().rsplit(": ", 1)[-1] for r in lines] == [
        "etcd leader changed", "TimeoutError", "the object has been modified"]
    assert all("chat" in r.getMessage() and r.exc_info is None for r in lines)


async def test_a_failed_status_write_after_a_reconcile_is_retried_by_kopf(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The children applied, the status write fails: a TemporaryError with the API errors'
    backoff (kopf: one line, a retry), not an exception with a traceback; the retry writes
    the status (observedGeneration) of the generation."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"replicas": 3}})
        _fail_status_writes(monkeypatch, [ApiError(500, "InternalError", "boom")])
        with pytest.raises(kopf.TemporaryError, match="500 InternalError: boom") as err:
            await _reconcile(api, retry=1)
        assert err.value.delay == handlers.apply_retry_delay(1)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 3
        assert (await _status(api))["observedGeneration"] == 1
        await _reconcile(api, retry=2)
    assert (await _status(api))["observedGeneration"] == 2
