"""A careless or hostile `kubectl apply`: specs the CRD admits but the children cannot take,
objects in the children's way, API errors. Each must end in a clear status condition and a
Warning event, not in a half-applied set of children or a silent retry loop."""

from __future__ import annotations

import logging
from typing import Any

import kmock
import kopf
import pytest
from crd_schema import validate
from operator_helpers import NS, Api, settle, wait_for_degraded
from test_operator_handlers import (
    CM_PATH,
    DEP_PATH,
    EVENT_PATH,
    LLMD_PATH,
    SVC_PATH,
    _cond,
    _status,
    llmd,
    reconciled_by_the_handlers,
    writes,
)


def _children_written(kube: Any) -> list[Any]:
    """The operator's creates and patches of children (not of the LLMDeployment, its status
    or Events)."""
    return [r for r in writes(kube) if r.method in ("POST", "PATCH")
            and r.headers.get("User-Agent", "").startswith("argosy-operator/")
            and "/llmdeployments" not in str(r.url) and "/events" not in str(r.url)]


@pytest.mark.parametrize("name", ["llama-3.1", "l" * 64])
async def test_a_name_the_children_cannot_take_is_reported_and_nothing_is_applied(
        kube: Any, api: Api, run_operator: Any, name: str) -> None:
    """An LLMDeployment's name is a DNS subdomain (dots, up to 253 characters), but its
    Service must be named by a DNS-1035 label and every child carries the name as a label
    value (at most 63 characters). The CRD refuses such a name (test_operator_crd_schema);
    under a CRD from before that rule, it is an InvalidSpec naming metadata.name, before any
    child is written: not a Deployment created and then a Service refused every 10 s."""
    kube.crd_validation = False  # an older CRD, without the name rule
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd(name), "application/json")
        cond = await wait_for_degraded(api, "InvalidSpec", name)
        await settle(kube)
    assert cond["status"] == "True" and "metadata.name" in cond["message"]
    assert _children_written(kube) == []
    assert await api.get_or_none(f"{DEP_PATH}/{name}") is None
    warnings = [r.data for r in writes(kube, EVENT_PATH) if r.data["type"] == "Warning"]
    assert [w["reason"] for w in warnings] == ["InvalidSpec"]


async def test_a_foreign_object_in_the_way_stops_the_reconcile_before_any_write(
        kube: Any, api: Api, run_operator: Any) -> None:
    """Someone's Service already holds the name: the operator reports ChildConflict and
    writes none of the children (the LoRA ConfigMap and the Deployment come before the
    Service), rather than leaving a Deployment whose pods no Service reaches."""
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "chat", "namespace": NS},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}
    await api.call("POST", SVC_PATH, foreign, "application/json")
    spec = llmd()
    spec["spec"]["runtime"] = {"loraAdapters": []}
    with run_operator():
        await api.call("POST", LLMD_PATH, spec, "application/json")
        cond = await wait_for_degraded(api, "ChildConflict")
        await settle(kube)
    assert "Service chat exists and is not managed" in cond["message"]
    assert _children_written(kube) == []
    assert await api.get_or_none(f"{DEP_PATH}/chat") is None
    assert await api.get_or_none(f"{CM_PATH}/chat") is None


def _refuse_service_creates(kube: Any, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The emulated API server answers Service creates with 403 (RBAC) until the test sets
    `refusing[0]` (the returned list) to False."""
    refusing = [True]
    prepare = kube._prepare_create

    def refuse(request: Any) -> None:
        if request.resource.plural == "services" and refusing[0]:
            raise kmock.KubernetesError(
                status=403, reason="Forbidden",
                message='services is forbidden: User "system:serviceaccount:argosy-system:'
                        'argosy-operator" cannot create resource "services"')
        prepare(request)

    monkeypatch.setattr(kube, "_prepare_create", refuse)
    return refusing


async def test_an_api_error_on_a_child_is_a_condition_and_backs_off(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child the API server refuses (403 from RBAC here; 422, 5xx alike): Degraded=True
    ApplyFailed naming the child and the answer (one Warning event, not one per retry), kopf
    retries later and later, and the condition clears once a reconcile succeeds."""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)) as events:
        await api.call("DELETE", f"{SVC_PATH}/chat")
        refusing = _refuse_service_creates(kube, monkeypatch)
        body = await api.call("GET", f"{LLMD_PATH}/chat")
        delays = []
        for retry in range(3):
            with pytest.raises(kopf.TemporaryError) as err:
                await handlers.reconcile_llmdeployment(
                    body=body, meta=body["metadata"], logger=logging.getLogger("test"),
                    retry=retry)
            delays.append(err.value.delay)
            cond = _cond(await _status(api), "Degraded")
            assert (cond["status"], cond["reason"]) == ("True", "ApplyFailed")
            assert "Service" in cond["message"] and "403" in cond["message"]
        assert delays == sorted(delays) and delays[0] < delays[-1]
        assert [e["reason"] for e in events if e["type"] == "Warning"] == ["ApplyFailed"]
        # A pod event's status refresh does not hide the failure.
        await handlers._refresh_owner(NS, "chat")
        assert _cond(await _status(api), "Degraded")["reason"] == "ApplyFailed"
        refusing[0] = False
        body = await api.call("GET", f"{LLMD_PATH}/chat")  # kopf retries with the latest
        await handlers.reconcile_llmdeployment(body=body, meta=body["metadata"],
                                               logger=logging.getLogger("test"), retry=3)
    assert await api.get_or_none(f"{SVC_PATH}/chat") is not None
    assert _cond(await _status(api), "Degraded")["status"] == "False"


async def _reconcile_delay(retry: int, api: Api) -> float:
    """kopf's retry delay from one create/update reconcile that must fail (TemporaryError)."""
    from argosy_operator import handlers

    body = await api.call("GET", f"{LLMD_PATH}/chat")
    with pytest.raises(kopf.TemporaryError) as err:
        await handlers.reconcile_llmdeployment(body=body, meta=body["metadata"],
                                               logger=logging.getLogger("test"), retry=retry)
    return err.value.delay


async def test_a_child_being_deleted_is_retried_soon_and_a_foreign_one_backs_off(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child held by a finalizer while it is deleted (an LLMDeployment deleted and applied
    again, as GitOps tools replace one) goes away by itself: retried within seconds, and
    re-created once it is gone. Someone else's object in a child's place stays until a
    person acts: retried later and later. (Both waited a fixed 30 s.)"""
    from argosy_operator import handlers

    async with reconciled_by_the_handlers(kube, api, monkeypatch, (0.05,)):
        await api.call("PATCH", f"{SVC_PATH}/chat",
                       {"metadata": {"finalizers": ["example.com/hold"]}},
                       "application/merge-patch+json")
        await api.call("DELETE", f"{SVC_PATH}/chat")
        assert (await api.get_or_none(f"{SVC_PATH}/chat"))["metadata"]["deletionTimestamp"]
        soon = [await _reconcile_delay(retry, api) for retry in range(2)]
        assert soon == [handlers.reapply_retry_delay(0), handlers.reapply_retry_delay(1)]
        assert soon[0] <= 1.0
        assert "being deleted" in _cond(await _status(api), "Degraded")["message"]
        await api.call("PATCH", f"{SVC_PATH}/chat", {"metadata": {"finalizers": None}},
                       "application/merge-patch+json")
        assert await api.get_or_none(f"{SVC_PATH}/chat") is None  # gone with its finalizer
        body = await api.call("GET", f"{LLMD_PATH}/chat")
        await handlers.reconcile_llmdeployment(body=body, meta=body["metadata"],
                                               logger=logging.getLogger("test"), retry=2)
        assert (await api.get_or_none(f"{SVC_PATH}/chat"))["metadata"]["labels"]

        await api.call("DELETE", f"{SVC_PATH}/chat")
        await api.call("POST", SVC_PATH, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "chat", "namespace": NS},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}, "application/json")
        later = [await _reconcile_delay(retry, api) for retry in range(4)]
        assert later == [handlers.apply_retry_delay(r) for r in range(4)]
        assert later == sorted(later) and later[0] >= 10 and later[-1] > later[0]


@pytest.mark.parametrize("interval", ["1s1m", "15s15s", "30ms1h"])
def test_a_scrape_interval_the_servicemonitor_refuses_is_an_invalid_spec(interval: str
                                                                        ) -> None:
    """The Prometheus Operator's ServiceMonitor CRD (units largest first, each once) refuses
    these, which would fail the last child of every reconcile. The CRD refuses them now; the
    operator, under an older CRD that admitted them, names the field before applying
    anything."""
    from argosy_operator.spec import normalize_spec

    obj = llmd(monitoring={"interval": interval})
    _, errors = validate(obj)
    assert any("monitoring.interval" in e for e in errors), errors
    with pytest.raises(ValueError, match="spec.monitoring.interval"):
        normalize_spec(obj["spec"])
    for fine in ("15s", "1m30s", "1h", "500ms", "2h5m10s100ms"):
        normalize_spec(llmd(monitoring={"interval": fine})["spec"])


@pytest.mark.parametrize("extra", [["--port", "9000"], ["--host=127.0.0.1"],
                                   ["--model", "/elsewhere"], ["--served-model-name", "x"],
                                   ["--lora-modules-file", "/tmp/a.json"]])
def test_extra_args_that_override_the_operators_own_flags_are_an_invalid_spec(
        extra: list[str]) -> None:
    """extraArgs come last and the last flag wins: `--port 9000` there would leave every
    probe and the Service on 8000, pods never ready and nothing saying why. The CRD refuses
    them; under an older CRD, the operator names the field and the flag."""
    from argosy_operator.spec import normalize_spec

    obj = llmd(runtime={"extraArgs": extra})
    assert any("runtime.extraArgs must not set" in e for e in validate(obj)[1])
    flag = extra[0].split("=")[0]
    with pytest.raises(ValueError, match=f"spec.runtime.extraArgs: {flag} is set by the "
                                         "operator"):
        normalize_spec(obj["spec"])
    # The documented override of a derived flag stays allowed.
    normalize_spec(llmd(runtime={"extraArgs": ["--tensor-parallel-size", "1",
                                               "--portable-thing"]})["spec"])


@pytest.mark.parametrize("spec, field", [
    ({"podTemplate": {"labels": {"team": "ml platform"}}}, "spec.podTemplate.labels.team"),
    ({"podTemplate": {"labels": {"tier": "x" * 64}}}, "spec.podTemplate.labels.tier"),
    ({"podTemplate": {"annotations": {"not a key": "v"}}}, "spec.podTemplate.annotations"),
    ({"monitoring": {"labels": {"release": "prometheus/stack"}}},
     "spec.monitoring.labels.release"),
    ({"service": {"annotations": {"Example.com/lb": "v"}}}, "spec.service.annotations"),
    ({"resources": {"cpu": "-1"}}, "spec.resources.cpu"),
    ({"resources": {"memory": "-4Gi"}}, "spec.resources.memory"),
])
def test_labels_annotations_and_quantities_the_api_server_refuses_are_an_invalid_spec(
        spec: dict[str, Any], field: str) -> None:
    """The CRD admits a signed quantity, and an older CRD any string in these maps (the CRD
    refuses them now: test_operator_crd_schema); the API server refuses the child that carries
    them (the ServiceMonitor's labels: after every other child was applied). The operator
    names the field before applying anything."""
    from argosy_operator.spec import normalize_spec

    obj = llmd(**spec)
    assert bool(validate(obj)[1]) == (not field.startswith("spec.resources"))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        normalize_spec(obj["spec"])


def test_valid_labels_annotations_and_quantities_pass() -> None:
    from argosy_operator.spec import normalize_spec

    normalize_spec(llmd(podTemplate={"labels": {"team": "ml", "example.com/tier": "",
                                                "a_b.c-d": "v1.2_x"},
                                     "annotations": {"example.com/note": "any text at all"}},
                        monitoring={"labels": {"release": "prometheus"}},
                        service={"annotations": {"service.beta.kubernetes.io/x": "y z"}},
                        resources={"cpu": "1e3", "memory": "0"})["spec"])


def test_the_status_of_a_refused_spec_is_still_computed() -> None:
    """An LLMDeployment applied before the operator checked its interval keeps its children;
    their pod and Deployment events still refresh its status, which must not raise (a
    traceback per event) on the spec the reconcile now refuses as InvalidSpec."""
    from argosy_operator.status import compute_status

    obj = llmd(monitoring={"interval": "30s1m"})
    obj["metadata"]["uid"] = "u1"
    deployment = {"metadata": {"generation": 1},
                  "spec": {"replicas": 2},
                  "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2,
                             "updatedReplicas": 2}}
    status = compute_status(obj, deployment, [], 1)
    assert status["readyReplicas"] == 2 and status["model"] == "smollm2"
