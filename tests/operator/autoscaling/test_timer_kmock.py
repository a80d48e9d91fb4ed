"""The real kopf timer against kmock's emulated Kubernetes API, scraping live test servers.

The emulated API holds an LLMDeployment, its Deployment and pods; each pod's status.podIP is
127.0.0.1 and its `prometheus.io/port` annotation is the port of a live aiohttp server that
serves Prometheus text (made with prometheus_client). A small fake ReplicaSet controller in the
test keeps the pods in step with the Deployment's spec.replicas, as the cluster would.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import kmock
import kopf
import pytest
from aiohttp import web
from argosy_operator.autoscaling import timer as autoscaling_timer
from kopf.testing import KopfRunner
from prometheus_client import CollectorRegistry, Gauge, generate_latest

NS = "default"
LLMD = kmock.resource("argosy.dev/v1alpha1/llmdeployments")
DEPLOYMENTS = kmock.resource("apps/v1/deployments")
PODS = kmock.resource("v1/pods")
EVENTS = kmock.resource("v1/events")

pytestmark = pytest.mark.timeout(120)


class MetricsServer:
    """One replica's /metrics on 127.0.0.1:<ephemeral port>; `values` is mutable."""

    def __init__(self) -> None:
        self.values = {"kv": 0.1, "waiting": 0.0, "running": 1.0}
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        registry = CollectorRegistry()
        Gauge("argosy:kv_cache_usage_perc", "KV cache usage", ["model_name"],
              registry=registry).labels("m").set(self.values["kv"])
        Gauge("argosy:num_requests_waiting", "waiting", ["model_name"],
              registry=registry).labels("m").set(self.values["waiting"])
        Gauge("argosy:num_requests_running", "running", ["model_name"],
              registry=registry).labels("m").set(self.values["running"])
        return web.Response(body=generate_latest(registry),
                            content_type="text/plain", charset="utf-8")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def llmd(name: str, uid: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": uid, "resourceVersion": "1"},
        "spec": {"model": {"name": "smollm2-135m"}, "replicas": 2, "autoscaling": autoscaling},
        # The reconciler's condition must survive the autoscaler's status writes.
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Available",
                                   "message": "2/2 ready",
                                   "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
    }


def deployment(name: str, uid: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "uid": f"dep-{uid}",
                     "ownerReferences": [{"apiVersion": "argosy.dev/v1alpha1",
                                          "kind": "LLMDeployment", "name": name, "uid": uid,
                                          "controller": True}]},
        "spec": {"replicas": replicas,
                 "selector": {"matchLabels": {"argosy.dev/llmdeployment": name}}},
    }


def pod(owner: str, index: int, port: int, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{owner}-{index}", "namespace": NS,
                     "labels": {"argosy.dev/llmdeployment": owner},
                     "annotations": {"prometheus.io/port": str(port)}},
        "status": {"podIP": "127.0.0.1", "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@contextlib.asynccontextmanager
async def replica_set_controller(emulator: Any, owner: str,
                                 servers: list[MetricsServer]) -> AsyncIterator[None]:
    """Keep pods `owner-0..N-1` in step with the Deployment's spec.replicas (N <= len(servers))."""
    async def loop() -> None:
        while True:
            want = int(emulator.objects[DEPLOYMENTS, NS, owner]["spec"]["replicas"])
            for i, server in enumerate(servers):
                key = (PODS, NS, f"{owner}-{i}")
                exists = key in emulator.objects and not emulator.objects[key].deleted
                if i < want and not exists:
                    emulator.objects[key] = pod(owner, i, server.port)
                elif i >= want and exists:
                    emulator.objects[key].delete()
            await asyncio.sleep(0.1)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for(predicate: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def replicas_of(emulator: Any, name: str) -> int:
    return int(emulator.objects[DEPLOYMENTS, NS, name]["spec"]["replicas"])


def status_of(emulator: Any, name: str) -> dict[str, Any]:
    return dict(emulator.objects[LLMD, NS, name].get("status") or {})


def events_for(emulator: Any, name: str) -> list[dict[str, Any]]:
    """Events POSTed for `name`, from the emulator's request log: kopf names events by
    generateName, which kmock 0.8 does not expand, so only the first would be stored."""
    out = []
    for request in list(emulator[EVENTS]):
        if request.method == kmock.method.POST and isinstance(request.data, dict):
            if (request.data.get("involvedObject") or {}).get("name") == name:
                out.append(request.data)
    return out


FAST = {  # the contract's semantics, on a test-sized clock
    "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
    "scrapeIntervalSeconds": 0.5, "stableWindowSeconds": 3, "panicWindowSeconds": 1,
    "scaleDownStabilizationSeconds": 3,
}


@pytest.fixture(autouse=True)
def fast_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autoscaling_timer, "TICK_SECONDS", 0.25)


async def test_timer_scales_deployment_from_live_metrics(kmock: Any) -> None:
    servers = [MetricsServer() for _ in range(4)]
    idle_servers = [MetricsServer() for _ in range(2)]
    for s in servers + idle_servers:
        await s.start()
    # kopf's observers (and its event poster) wait for the CRD, Namespace and Event resources
    # to be discoverable. kopf would
    # then list namespaces, which kmock 0.8 cannot parse (GET /api/v1/namespaces -> 500), so
    # scanning is disabled below and kopf serves the --namespace given, as in a RBAC-restricted
    # deployment.
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"})
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"list", "watch", "get"})
    kmock.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", namespaced=True, verbs={"create", "list", "get"})
    kmock.resources["argosy.dev/v1alpha1/llmdeployments"] = kmock.ResourceInfo(
        kind="LLMDeployment", namespaced=True, verbs={"list", "watch", "get", "patch"},
        subresources={"status", "scale"})
    kmock.objects[LLMD, NS, "llm"] = llmd("llm", "uid-llm", FAST)
    kmock.objects[DEPLOYMENTS, NS, "llm"] = deployment("llm", "uid-llm", 2)
    # A second deployment with autoscaling disabled and the same overload: must stay untouched.
    kmock.objects[LLMD, NS, "manual"] = llmd("manual", "uid-manual", {**FAST, "enabled": False})
    kmock.objects[DEPLOYMENTS, NS, "manual"] = deployment("manual", "uid-manual", 2)
    for i, s in enumerate(idle_servers):
        s.values = {"kv": 0.9, "waiting": 50.0, "running": 8.0}
        kmock.objects[PODS, NS, f"manual-{i}"] = pod("manual", i, s.port)

    registry = kopf.OperatorRegistry()
    autoscaling_timer.register(registry)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"))

    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    runner = KopfRunner(["run", "--standalone", f"--namespace={NS}", "--verbose"],
                        registry=registry, settings=settings, timeout=30)
    try:
        async with replica_set_controller(kmock, "llm", servers):
            await asyncio.to_thread(runner.__enter__)
            # 1) Steady load at target: status is written, replicas stay.
            for s in servers:
                s.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
            await wait_for(lambda: "desiredReplicas" in status_of(kmock, "llm"), 20,
                           "the first status write")
            st = status_of(kmock, "llm")
            assert st["desiredReplicas"] == 2 and replicas_of(kmock, "llm") == 2
            assert st["queueDepth"] == pytest.approx(4.0)
            assert st["kvCacheUtilization"] == pytest.approx(0.3)
            assert st["kvCachePercent"] == 30
            conds = {c["type"]: c for c in st["conditions"]}
            assert conds["Ready"]["reason"] == "Available"  # the reconciler's, untouched
            assert conds["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
            assert conds["ScalingActive"]["status"] == "True"
            assert conds["ScalingLimited"]["status"] == "False"

            # 2) A spike: 4x the target queue on every replica -> panic, x2 at once, then max.
            for s in servers:
                s.values = {"kv": 0.6, "waiting": 16.0, "running": 8.0}
            await wait_for(lambda: replicas_of(kmock, "llm") == 4, 20, "scale-up to 4")
            await wait_for(lambda: status_of(kmock, "llm").get("desiredReplicas") == 4, 10,
                           "status.desiredReplicas == 4")
            st = status_of(kmock, "llm")
            assert st["autoscaling"]["reason"] in {"PanicScaleUp", "AtMaxReplicas", "PanicHold"}
            assert st["lastScaleTime"].endswith("Z")
            await wait_for(lambda: any(e.get("reason") == "ScaledUp"
                                       for e in events_for(kmock, "llm")), 10, "a ScaledUp event")
            ups = [e for e in events_for(kmock, "llm") if e.get("reason") == "ScaledUp"]
            assert "2 -> 4" in ups[0]["message"] and ups[0]["type"] == "Normal"
            # New pods came up and are scraped too (the fake controller made llm-2, llm-3).
            await wait_for(lambda: servers[3].hits > 0, 10, "the new replica to be scraped")
            await wait_for(lambda: status_of(kmock, "llm").get("autoscaling", {})
                           .get("reason") == "AtMaxReplicas", 10, "AtMaxReplicas")
            conds = {c["type"]: c for c in status_of(kmock, "llm")["conditions"]}
            assert conds["ScalingLimited"]["status"] == "True"
            assert conds["ScalingLimited"]["reason"] == "TooManyReplicas"

            # 3) Load drops: down only after panic and the scale-down stabilization window.
            for s in servers:
                s.values = {"kv": 0.05, "waiting": 0.0, "running": 0.0}
            t_drop = time.monotonic()
            await wait_for(lambda: replicas_of(kmock, "llm") < 4, 30, "a scale-down")
            assert time.monotonic() - t_drop >= FAST["scaleDownStabilizationSeconds"]
            await wait_for(lambda: replicas_of(kmock, "llm") == 1, 30, "scale-down to minReplicas")
            await wait_for(lambda: len([e for e in events_for(kmock, "llm")
                                        if e.get("reason") == "ScaledDown"]) >= 2, 10,
                           "ScaledDown events (4 -> 2 -> 1 at most halving)")
            await wait_for(lambda: status_of(kmock, "llm").get("desiredReplicas") == 1, 10,
                           "status.desiredReplicas == 1")

            # Autoscaling disabled: never scraped, never patched, no status from the autoscaler.
            assert all(s.hits == 0 for s in idle_servers)
            assert replicas_of(kmock, "manual") == 2
            assert "desiredReplicas" not in status_of(kmock, "manual")
            assert events_for(kmock, "manual") == []
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
        for s in servers + idle_servers:
            await s.stop()
