"""A refused spec (InvalidSpec, admitted by an older CRD) changes nothing and reports steadily:
no child is written or scaled, the conditions say so without flapping until a spec is
applied, and the operator's log says it once per generation (the handlers and the autoscaling
timer called directly on the emulated API server)."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from operator_helpers import NS, Api
from test_operator_failure_status import (
    _reconcile,
    _refuse_an_edit,
    autoscale_tick,
    refuse_an_autoscaling_edit,
)
from test_operator_handlers import DEP_PATH, LLMD_PATH, _cond, _status, reconciled_by_the_handlers

CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"
OWNER = {"labels": {"argosy.dev/llmdeployment": "chat"}}


async def _pods_ready(api: Api, ready: int) -> None:
    """The Deployment controller reports `ready` of 2 replicas ready."""
    dep = await api.call("GET", f"{DEP_PATH}/chat")
    await api.call("PATCH", f"{DEP_PATH}/chat/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 2,
        "updatedReplicas": 2, "readyReplicas": ready, "availableReplicas": ready}})


async def test_ready_stays_false_from_one_refused_spec_to_the_next(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation 2 refused, then generation 3, refused too. A child's event between the
    edit and its reconcile (the pods of generation 1 are all ready) must not report the
    children's Ready=True and Stalled=False in between: Ready stays False and Stalled True,
    from one refusal to the next."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await _pods_ready(api, 2)
        await handlers.pod_changed(meta=OWNER, namespace=NS)
        assert _cond(await _status(api), "Ready")["status"] == "True"
        await _refuse_an_edit(kube, api)  # generation 2
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "runtime": {"extraArgs": ["--port=9000"]}}})  # generation 3
        # A pod event and a Deployment event (a hand edit, which cannot be reverted from a
        # refused spec) before the reconcile of generation 3.
        await handlers.pod_changed(meta=OWNER, namespace=NS)
        await api.call("PATCH", f"{DEP_PATH}/chat", {"spec": {"replicas": 5}})
        dep = await api.call("GET", f"{DEP_PATH}/chat")
        await handlers.deployment_changed(event={"type": "MODIFIED"}, body=dep,
                                          meta=dep["metadata"], namespace=NS)
        status = await _status(api)
        for type_, want in (("Ready", "False"), ("Progressing", "False"),
                            ("Degraded", "True"), ("Stalled", "True")):
            cond = _cond(status, type_)
            assert (cond["status"], cond["reason"]) == (want, "InvalidSpec"), status

        with pytest.raises(kopf.PermanentError, match="--port"):
            await _reconcile(api)
        status = await _status(api)
        for type_, want in (("Ready", "False"), ("Stalled", "True")):
            cond = _cond(status, type_)
            assert (cond["status"], cond["reason"], cond["observedGeneration"]) == (
                want, "InvalidSpec", 3), status
            assert "--port" in cond["message"]


async def test_a_refused_model_source_writes_no_child(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit that changes the LoRA adapters and gives a model.source the operator cannot
    parse: refused as a whole, so the adapters' ConfigMap keeps the last applied list (it
    was patched before the Deployment's builder refused the source), and no child is
    written at all."""
    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {
            "loraAdapters": [{"name": "sql", "path": "/adapters/sql"}]}}})
        await _reconcile(api)
        before = await api.call("GET", f"{CM_PATH}/chat")
        kube.crd_validation = False
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "model": {"path": None, "source": "ftp://models/llama"},
            "runtime": {"loraAdapters": [{"name": "sql", "path": "/adapters/sql"},
                                         {"name": "chat", "path": "/adapters/chat"}]}}})
        seen = len(list(kube))
        with pytest.raises(kopf.PermanentError, match="spec.model.source"):
            await _reconcile(api)
        child_writes = [f"{r.method} {r.url.path}" for r in list(kube)[seen:]
                        if r.method in ("POST", "PATCH", "PUT", "DELETE")
                        and "/llmdeployments/" not in r.url.path
                        and "/events" not in r.url.path]
        assert child_writes == []
        after = await api.call("GET", f"{CM_PATH}/chat")
        assert after["data"] == before["data"]
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        stalled = _cond(await _status(api), "Stalled")
        assert (stalled["status"], stalled["reason"]) == ("True", "InvalidSpec")


async def test_a_child_edited_while_the_spec_is_refused_is_logged_once_per_generation(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The Deployment scaled by hand while the spec is refused, then three status updates of
    it: every event finds it drifted, and none can revert it. The operator's log says so once
    for the refused generation (the "spec is refused" warning), not a "reverting it" line per
    event (which would also be untrue: nothing is reverted)."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await _refuse_an_edit(kube, api)
        await api.call("PATCH", f"{DEP_PATH}/chat", {"spec": {"replicas": 5}})
        with caplog.at_level(logging.INFO, logger="argosy.operator"):
            for ready in (0, 1, 2):
                await _pods_ready(api, ready)
                dep = await api.call("GET", f"{DEP_PATH}/chat")
                await handlers.deployment_changed(event={"type": "MODIFIED"}, body=dep,
                                                  meta=dep["metadata"], namespace=NS)
        lines = [r.getMessage() for r in caplog.records if r.name == "argosy.operator"]
        assert len(lines) == 1 and "spec is refused" in lines[0], lines
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 5

        # Once the spec is fixed, the next edit is reverted, and logged, as ever.
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"monitoring": {"interval": "30s"}}})
        await _reconcile(api)
        await api.call("PATCH", f"{DEP_PATH}/chat", {"spec": {"replicas": 7}})
        dep = await api.call("GET", f"{DEP_PATH}/chat")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="argosy.operator"):
            await handlers.deployment_changed(event={"type": "MODIFIED"}, body=dep,
                                              meta=dep["metadata"], namespace=NS)
        lines = [r.getMessage() for r in caplog.records if r.name == "argosy.operator"]
        assert len(lines) == 1 and "spec.replicas" in lines[0], lines
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 2


async def test_the_autoscaler_does_not_act_on_a_refused_spec_replacing_a_refused_one(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation 2 refused (autoscaling on, minReplicas 4), then generation 3, refused too
    (minReplicas 5). A timer tick between the edit and its reconcile must not scale the
    Deployment of the last applied spec (2 replicas) to the new spec's minReplicas, and
    ScalingActive stays False/SpecRefused."""
    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await refuse_an_autoscaling_edit(kube, api)
        await autoscale_tick(api)
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {
            "runtime": {"extraArgs": ["--port=8"]}, "autoscaling": {"minReplicas": 5}}})
        await autoscale_tick(api)
        assert (await api.call("GET", f"{DEP_PATH}/chat"))["spec"]["replicas"] == 2
        active = _cond(await _status(api), "ScalingActive")
        assert (active["status"], active["reason"]) == ("False", "SpecRefused"), active
