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


async def test_a_plain_text_5xx_is_retried_not_taken_for_a_refused_spec(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy in front of the API server answers one read of a reconcile with a plain-text
    503: an API error, retried (ApplyFailed, in progress), not a refused spec (it was a
    JSONDecodeError, a ValueError, which the reconcile took for InvalidSpec: Stalled for
    good, and the edit never applied)."""
    import aiohttp.web

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        handle, failures = kube._handle, [1]

        async def proxy_hiccup(request: Any) -> Any:
            if request.method == "GET" and request.url.path == f"{DEP_PATH}/chat" \
                    and failures:
                failures.pop()
                return aiohttp.web.Response(
                    status=503, text="upstream connect error or disconnect/reset before headers")
            return await handle(request)

        monkeypatch.setattr(kube, "_handle", proxy_hiccup)
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"replicas": 3}})
        with pytest.raises(kopf.TemporaryError, match="503"):
            await _reconcile(api)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert _cond(obj["status"], "Degraded")["reason"] == "ApplyFailed"
        assert "upstream connect error" in _cond(obj["status"], "Degraded")["message"]
        assert _cond(obj["status"], "Stalled") == {}
        assert kstatus(obj) == "InProgress"
        await _reconcile(api, retry=1)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 3
        assert kstatus(await api.call("GET", f"{LLMD_PATH}/chat")) == "Current"


async def test_a_discovery_5xx_fails_the_reconcile_not_the_servicemonitor(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy's plain-text 503 to the ServiceMonitor discovery request is no answer, not "the
    CRD is absent": the reconcile fails (ApplyFailed, retried, generation not observed) and is
    not cached, so the retry applies the edit (it succeeded without touching the
    ServiceMonitor, recorded the generation, and the unwanted ServiceMonitor stayed)."""
    import aiohttp.web
    from argosy_operator import handlers
    from argosy_operator.kube import SERVICEMONITORS

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        sm_path = SERVICEMONITORS.path(NS, "chat")
        assert await api.get_or_none(sm_path) is not None
        handlers._state["client"].forget_discovery(SERVICEMONITORS)
        handle, failures = kube._handle, [1]

        async def proxy_hiccup(request: Any) -> Any:
            if request.method == "GET" and failures \
                    and request.url.path == SERVICEMONITORS.discovery_path:
                failures.pop()
                return aiohttp.web.Response(status=503, text="upstream connect error")
            return await handle(request)

        monkeypatch.setattr(kube, "_handle", proxy_hiccup)
        await api.call("PATCH", f"{LLMD_PATH}/chat",
                       {"spec": {"monitoring": {"serviceMonitor": False}}})
        with pytest.raises(kopf.TemporaryError, match="503"):
            await _reconcile(api)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert obj["status"]["observedGeneration"] == 1
        assert _cond(obj["status"], "Degraded")["reason"] == "ApplyFailed"
        assert kstatus(obj) == "InProgress"
        assert await api.get_or_none(sm_path) is not None
        await _reconcile(api, retry=1)
        assert await api.get_or_none(sm_path) is None
        assert kstatus(await api.call("GET", f"{LLMD_PATH}/chat")) == "Current"


async def test_a_value_error_that_is_not_about_the_spec_is_not_a_refused_spec(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only InvalidSpecError is a refused spec: any other ValueError out of a reconcile (a
    bug, an answer the client could not decode) goes to kopf, which retries it, and the
    status neither records the generation nor says Stalled."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        client = handlers._state["client"]
        request, failures = client.request, [ValueError("Expecting value: line 1 column 1")]

        async def undecodable(method: str, path: str, **kwargs: Any) -> Any:
            if method == "GET" and path == f"{DEP_PATH}/chat" and failures:
                raise failures.pop()
            return await request(method, path, **kwargs)

        monkeypatch.setattr(client, "request", undecodable)
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"replicas": 3}})
        with pytest.raises(ValueError, match="Expecting value") as err:
            await _reconcile(api)
        assert not isinstance(err.value, kopf.PermanentError)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert obj["status"]["observedGeneration"] == 1
        assert _cond(obj["status"], "Stalled") == {}
        await _reconcile(api, retry=1)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 3


async def _refuse_an_edit(kube: Any, api: Api) -> None:
    """Generation 2: an interval the ServiceMonitor refuses (admitted by an older CRD)."""
    kube.crd_validation = False
    await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"monitoring": {"interval": "1s1m"}}})
    with pytest.raises(kopf.PermanentError):
        await _reconcile(api)
    assert kstatus(await api.call("GET", f"{LLMD_PATH}/chat")) == "Failed"


async def refuse_an_autoscaling_edit(kube: Any, api: Api) -> None:
    """Generation 2: autoscaling turned on (minReplicas 4) beside a flag the operator
    refuses (admitted by an older CRD)."""
    kube.crd_validation = False
    await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
        "runtime": {"extraArgs": ["--port=9"]},
        "autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 6}}})
    with pytest.raises(kopf.PermanentError):
        await _reconcile(api)


async def autoscale_tick(api: Api) -> None:
    """One tick of the autoscaling timer on the LLMDeployment as stored now."""
    from argosy_operator.autoscaling import timer

    obj = await api.call("GET", f"{LLMD_PATH}/chat")
    await timer.autoscale(body=obj, spec=obj["spec"], name="chat", namespace=NS,
                          memo=kopf.Memo(), logger=logging.getLogger("test"))


async def test_a_fixed_spec_failing_with_a_retried_error_is_no_longer_stalled(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused spec fixed by an edit whose reconcile then fails in a way that is retried
    (someone else's Service in the way): the old refusal's Stalled=True and Ready/Progressing
    InvalidSpec go at once (in progress, not failed), and pod events do not bring them back
    (they froze the conditions of any stored Stalled=True, whatever its generation)."""
    from argosy_operator import handlers

    svc_path = f"/api/v1/namespaces/{NS}/services"
    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await _refuse_an_edit(kube, api)
        await api.call("DELETE", f"{svc_path}/chat")
        await api.call("POST", svc_path, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "chat", "namespace": NS, "labels": {"team": "web"}},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}, "application/json")
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"monitoring": {"interval": "30s"}}})
        with pytest.raises(kopf.TemporaryError, match="not managed by argosy-operator"):
            await _reconcile(api)

        def check(obj: dict[str, Any]) -> None:
            status = obj["status"]
            stalled = _cond(status, "Stalled")
            assert (stalled["status"], stalled["observedGeneration"]) == ("False", 3), stalled
            for type_ in ("Ready", "Progressing"):
                assert _cond(status, type_)["reason"] != "InvalidSpec", status
            degraded = _cond(status, "Degraded")
            assert (degraded["reason"], degraded["observedGeneration"]) == ("ChildConflict", 3)
            assert kstatus(obj) == "InProgress"

        check(await api.call("GET", f"{LLMD_PATH}/chat"))
        await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
            "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
            "availableReplicas": 2}})
        await handlers.pod_changed(meta={"labels": {"argosy.dev/llmdeployment": "chat"}},
                                   namespace=NS)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        check(obj)
        assert _cond(obj["status"], "Ready")["reason"] == "AllReplicasReady"

        await api.call("DELETE", f"{svc_path}/chat")  # the foreign Service goes away
        await _reconcile(api, retry=1)
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert _cond(obj["status"], "Stalled")["reason"] == "AsExpected"
        assert kstatus(obj) == "Current"


async def test_a_child_deleted_while_the_spec_is_refused_is_one_log_line(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The Service deleted by hand while the spec is refused: no child can be built from that
    spec, so the reapply says so in one warning (no traceback; the event handler died with
    one) and stops; the fixed spec brings the Service back."""
    from argosy_operator import handlers

    svc_path = f"/api/v1/namespaces/{NS}/services"
    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await _refuse_an_edit(kube, api)
        await api.call("DELETE", f"{svc_path}/chat")
        with caplog.at_level(logging.WARNING, logger="argosy.operator"):
            await handlers._refresh_owner(NS, "chat", reapply=True)
        lines = [r for r in caplog.records if r.name == "argosy.operator"]
        assert len(lines) == 1 and lines[0].exc_info is None
        assert "spec is refused" in lines[0].getMessage()
        assert "spec.monitoring.interval" in lines[0].getMessage()
        assert await api.get_or_none(f"{svc_path}/chat") is None
        assert kstatus(await api.call("GET", f"{LLMD_PATH}/chat")) == "Failed"

        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"monitoring": {"interval": "30s"}}})
        await _reconcile(api)
        assert await api.get_or_none(f"{svc_path}/chat") is not None


async def test_the_autoscaler_does_not_act_on_a_refused_spec(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused edit that turns autoscaling on (minReplicas 4): the autoscaling timer does
    not scale the running Deployment of the last applied spec (it scaled it to 4) and says
    why (ScalingActive False, SpecRefused); once a spec is applied it scales."""
    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await refuse_an_autoscaling_edit(kube, api)
        assert kstatus(await api.call("GET", f"{LLMD_PATH}/chat")) == "Failed"
        await autoscale_tick(api)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 2
        status = await _status(api)
        active = _cond(status, "ScalingActive")
        assert (active["status"], active["reason"]) == ("False", "SpecRefused"), active
        assert _cond(status, "Stalled")["status"] == "True"  # the timer left it

        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {"extraArgs": []}}})
        await _reconcile(api)
        await autoscale_tick(api)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 4


async def test_a_child_drifted_while_the_spec_is_refused_still_updates_the_status(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The Deployment scaled by hand while the spec is refused: it cannot be reverted from
    that spec, so the "spec is refused" warning comes once for the generation (not at every
    later event of the Deployment), and its events still update the replica counts (they
    stopped: the reapply returned before any status refresh); the refusal's conditions stay."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await _refuse_an_edit(kube, api)
        await api.call("PATCH", f"{DEP_PATH}/chat", {"spec": {"replicas": 5}})
        dep = await api.call("GET", f"{DEP_PATH}/chat")
        with caplog.at_level(logging.WARNING, logger="argosy.operator"):
            for ready in (1, 2, 3):
                await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
                    "observedGeneration": dep["metadata"]["generation"], "replicas": 5,
                    "updatedReplicas": 5, "readyReplicas": ready}})
                dep = await api.call("GET", f"{DEP_PATH}/chat")
                await handlers.deployment_changed(event={"type": "MODIFIED"}, body=dep,
                                                  meta=dep["metadata"], namespace=NS)
                status = await _status(api)
                assert (status["replicas"], status["readyReplicas"]) == (5, ready), status
        refused = [r for r in caplog.records
                   if r.name == "argosy.operator" and "spec is refused" in r.getMessage()]
        assert len(refused) == 1, [r.getMessage() for r in refused]
        obj = await api.call("GET", f"{LLMD_PATH}/chat")
        assert kstatus(obj) == "Failed"
        assert _cond(obj["status"], "Ready")["reason"] == "InvalidSpec"
        assert dep["spec"]["replicas"] == 5  # not reverted from the refused spec

        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"monitoring": {"interval": "30s"}}})
        await _reconcile(api)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 2


async def test_a_failed_child_conflict_report_is_a_temporary_error(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone else's Service in the way and the status write failing too: a TemporaryError
    with the conflict's backoff (as for every other failure of a reconcile), not the raw
    ApiError of the status write (kopf's traceback and its own retry delay)."""
    from argosy_operator import handlers

    svc_path = f"/api/v1/namespaces/{NS}/services"
    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("DELETE", f"{svc_path}/chat")
        await api.call("POST", svc_path, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "chat", "namespace": NS, "labels": {"team": "web"}},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}, "application/json")
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"replicas": 3}})
        _fail_status_writes(monkeypatch, [ApiError(503, "ServiceUnavailable", "etcd down")])
        with pytest.raises(kopf.TemporaryError, match="not managed by argosy-operator") as err:
            await _reconcile(api, retry=2)
        assert "etcd down" in str(err.value)
        assert err.value.delay == handlers.apply_retry_delay(2)
        await api.call("DELETE", f"{svc_path}/chat")  # the foreign Service goes away
        await _reconcile(api, retry=3)
        assert kstatus(await api.call("GET", f"{LLMD_PATH}/chat")) == "Current"


def test_only_a_refused_spec_is_an_invalid_spec_error() -> None:
    """The reconcile reports InvalidSpec (and stops retrying) only for InvalidSpecError,
    which each check of the spec raises; any other ValueError is retried."""
    from argosy_operator.builders.common import check_name
    from argosy_operator.model_source import parse_model_source
    from argosy_operator.spec import InvalidSpecError, normalize_spec

    for bad in (lambda: check_name("Chat.v1"),
                lambda: normalize_spec({"model": {"name": "m", "path": "/m"}, "replicas": -1}),
                lambda: normalize_spec({"model": {"name": "m", "path": "/m"}, "autoscaling": {
                    "enabled": True, "panicWindowSeconds": 90}}),
                lambda: parse_model_source("ftp://x", None)):
        with pytest.raises(InvalidSpecError):
            bad()
