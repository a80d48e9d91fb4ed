"""The real kopf operator (argosy_operator.handlers, which registers the autoscaling timer)
against the emulated Kubernetes API (kmock-based, tests/operator/kube_emulator.py), scraping
live loopback HTTP servers that serve Prometheus text.

Each runtime pod gets status.podIP 127.0.0.1 and a `prometheus.io/port` annotation naming its
own test server, so the scraper's production path (podIP + annotation) is what runs. A small
fake ReplicaSet controller in the test keeps the pods in step with the Deployment's
spec.replicas, as the cluster's controllers would, and picks the pods to delete by the
ReplicaSet's rules for ready pods: lowest `controller.kubernetes.io/pod-deletion-cost` first,
then the newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from aiohttp import web
from argosy_operator.autoscaling.deletion_cost import BATCH_COST, POD_DELETION_COST
from crd_schema import ROOT
from operator_helpers import NS, Api, eventually, granted_calls, operator_calls
from prometheus_client import CollectorRegistry, Gauge, generate_latest

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
EVENT_PATH = f"/api/v1/namespaces/{NS}/events"

pytestmark = pytest.mark.timeout(150)

# The contract's semantics on a test-sized clock (the timer ticks every second by default).
FAST = {
    "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
    "scrapeIntervalSeconds": 1, "stableWindowSeconds": 3, "panicWindowSeconds": 2,
    "scaleDownStabilizationSeconds": 4,
}


class MetricsServer:
    """One replica's /metrics on 127.0.0.1:<ephemeral port>; `values` is mutable."""

    def __init__(self) -> None:
        # "batch" (argosy:batch_requests_pending) is optional, as from an older runtime.
        self.values: dict[str, float] | None = {"kv": 0.1, "waiting": 0.0, "running": 1.0}
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.values is None:  # a broken replica: the scrape fails
            return web.Response(status=500, text="engine dead")
        registry = CollectorRegistry()
        for name, key in (("argosy:kv_cache_usage_perc", "kv"),
                          ("argosy:num_requests_waiting", "waiting"),
                          ("argosy:num_requests_running", "running"),
                          ("argosy:batch_requests_pending", "batch")):
            if key in self.values:
                Gauge(name, name, ["model_name"], registry=registry).labels("m").set(
                    self.values[key])
        return web.Response(body=generate_latest(registry), content_type="text/plain",
                            charset="utf-8")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def llmd(name: str, autoscaling: dict[str, Any],
         runtime: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {"model": {"name": "smollm2", "path": "smollm2-135m"}, "replicas": 2,
            "autoscaling": autoscaling}
    if runtime is not None:
        spec["runtime"] = runtime
    return {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


async def make_pod(api: Api, owner: str, index: int, port: int) -> None:
    """Create a ready runtime pod (as the ReplicaSet + kubelet would)."""
    name = f"{owner}-{index}"
    await api.call("POST", POD_PATH, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"argosy.dev/llmdeployment": owner},
                     "annotations": {"prometheus.io/port": str(port)}},
        "spec": {"containers": [{"name": "runtime", "image": "x"}]}}, "application/json")
    await api.call("PATCH", f"{POD_PATH}/{name}/status", {"status": {
        "phase": "Running", "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True"}]}})


@contextlib.asynccontextmanager
async def replica_set_controller(api: Api, owner: str,
                                 servers: list[MetricsServer]) -> AsyncIterator[None]:
    """Keep as many pods `owner-<i>` (one per server) as the Deployment's spec.replicas:
    create the lowest free indices; delete the lowest pod-deletion-cost, then the newest."""
    async def deletion_rank(i: int) -> tuple[int, int]:
        pod = await api.get_or_none(f"{POD_PATH}/{owner}-{i}")
        cost = (pod["metadata"].get("annotations") or {}).get(POD_DELETION_COST, "0")
        return int(cost), -i  # pod i is created after pods 0..i-1: higher i is newer

    async def loop() -> None:
        existing: set[int] = set()
        while True:
            dep = await api.get_or_none(f"{DEP_PATH}/{owner}")
            want = int(dep["spec"].get("replicas", 1)) if dep else 0
            while len(existing) < min(want, len(servers)):
                i = min(set(range(len(servers))) - existing)
                await make_pod(api, owner, i, servers[i].port)
                existing.add(i)
            if len(existing) > want:
                ranks = {i: await deletion_rank(i) for i in existing}
                for i in sorted(existing, key=ranks.__getitem__)[:len(existing) - want]:
                    await api.call("DELETE", f"{POD_PATH}/{owner}-{i}")
                    existing.discard(i)
            await asyncio.sleep(0.1)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        if task.done():
            task.result()  # the fake controller itself failed: surface its error
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def create_scaled_to(api: Api, name: str, count: int,
                           runtime: dict[str, Any] | None = None) -> None:
    """Create an autoscaled LLMDeployment, wait for its Deployment, and set that to `count`
    replicas (as if the autoscaler had just scaled it)."""
    await api.call("POST", LLMD_PATH, llmd(name, FAST, runtime), "application/json")
    await eventually(lambda: api.get_or_none(f"{DEP_PATH}/{name}"), 10, "Deployment")
    await api.call("PATCH", f"{DEP_PATH}/{name}", {"spec": {"replicas": count}})


async def replicas(api: Api, name: str) -> int | None:
    dep = await api.get_or_none(f"{DEP_PATH}/{name}")
    return None if dep is None else int(dep["spec"].get("replicas", 1))


async def status(api: Api, name: str) -> dict[str, Any]:
    obj = await api.get_or_none(f"{LLMD_PATH}/{name}")
    return (obj or {}).get("status", {})


def events(kube: Any, name: str, reason: str) -> list[dict[str, Any]]:
    return [r.data for r in list(kube)
            if r.method == "POST" and EVENT_PATH in str(r.url) and isinstance(r.data, dict)
            and (r.data.get("involvedObject") or {}).get("name") == name
            and r.data.get("reason") == reason]


def conditions(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st.get("conditions") or []}


async def test_timer_scales_deployment_from_live_metrics(kube: Any, api: Api,
                                                         run_operator: Any) -> None:
    servers = [MetricsServer() for _ in range(4)]
    manual_servers = [MetricsServer() for _ in range(2)]
    for s in servers + manual_servers:
        await s.start()
    # Autoscaling disabled, same overload: the timer must never touch it.
    await api.call("POST", LLMD_PATH, llmd("manual", {**FAST, "enabled": False}),
                   "application/json")
    for i, s in enumerate(manual_servers):
        s.values = {"kv": 0.95, "waiting": 50.0, "running": 8.0}
        await make_pod(api, "manual", i, s.port)
    await api.call("POST", LLMD_PATH, llmd("llm", FAST), "application/json")
    for s in servers:  # load exactly at target: 4 waiting per replica, KV under target
        s.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
    try:
        async with replica_set_controller(api, "llm", servers):
            with run_operator():
                # 1) Steady load at target on minReplicas: status written, replicas stay.
                # (A tick before the pod exists reports NoMetrics; wait for a measured one.)
                async def first_status() -> Any:
                    st = await status(api, "llm")
                    return st if "queueDepth" in st else None

                st = await eventually(first_status, 20, "the autoscaler's first status")
                assert st["desiredReplicas"] == 1 and await replicas(api, "llm") == 1
                assert st["queueDepth"] == pytest.approx(4.0)
                assert st["kvCacheUtilization"] == pytest.approx(0.3)
                assert st["kvCachePercent"] == 30
                assert st["autoscaling"]["reason"] == "WithinTolerance"
                conds = conditions(st)
                assert conds["ScalingActive"]["status"] == "True"
                assert conds["ScalingLimited"]["status"] == "False"
                assert {"Ready", "Progressing", "Degraded"} <= set(conds)  # the reconciler's

                # 2) A spike, 4x the target queue: panic, x2 per decision, up to maxReplicas.
                for s in servers:
                    s.values = {"kv": 0.6, "waiting": 16.0, "running": 8.0}
                t_spike = time.monotonic()

                async def at(n: int) -> bool:
                    return await replicas(api, "llm") == n

                await eventually(lambda: at(2), 10, "panic scale-up 1 -> 2")
                await eventually(lambda: at(4), 10, "scale-up 2 -> 4")
                assert time.monotonic() - t_spike < 8  # panic: no stable-window wait
                await eventually(lambda: asyncio.sleep(0, result=servers[3].hits > 0), 10,
                                 "the new replica to be scraped")

                async def limited() -> Any:
                    st = await status(api, "llm")
                    cond = conditions(st).get("ScalingLimited", {})
                    at_max = (cond.get("status"), cond.get("reason")) == ("True", "TooManyReplicas")
                    return st if at_max else None

                # (On the way up it may read ScaleUpLimit: x2 per decision.)
                st = await eventually(limited, 10, "ScalingLimited TooManyReplicas at max")
                assert st["desiredReplicas"] == 4 and st["lastScaleTime"].endswith("Z")
                ups = events(kube, "llm", "ScaledUp")
                assert [u["message"].split(":")[0] for u in ups[:2]] == [
                    "1 -> 2 replicas", "2 -> 4 replicas"]
                assert all(u["type"] == "Normal" for u in ups)

                # 3) Load drops: down only after the scale-down stabilization window.
                for s in servers:
                    s.values = {"kv": 0.02, "waiting": 0.0, "running": 0.0}
                t_drop = time.monotonic()
                await eventually(lambda: at(2), 30, "scale-down 4 -> 2 (at most halving)")
                assert time.monotonic() - t_drop >= FAST["scaleDownStabilizationSeconds"]
                await eventually(lambda: at(1), 30, "scale-down to minReplicas")

                async def settled_status() -> Any:
                    st = await status(api, "llm")
                    return st if st.get("desiredReplicas") == 1 else None

                st = await eventually(settled_status, 10, "status.desiredReplicas == 1")
                assert st["kvCachePercent"] <= 2
                downs = events(kube, "llm", "ScaledDown")
                assert [d["message"].split(":")[0] for d in downs] == [
                    "4 -> 2 replicas", "2 -> 1 replicas"]
    finally:
        for s in servers + manual_servers:
            await s.stop()

    # Autoscaling disabled: never scraped, replicas from spec, no autoscaler status or events.
    assert all(s.hits == 0 for s in manual_servers)
    assert await replicas(api, "manual") == 2
    st = await status(api, "manual")
    assert "desiredReplicas" not in st and "ScalingActive" not in conditions(st)
    assert events(kube, "manual", "ScaledUp") == events(kube, "manual", "ScaledDown") == []


async def test_failed_scrapes_never_scale_down(kube: Any, api: Api, run_operator: Any) -> None:
    servers = [MetricsServer() for _ in range(2)]
    for s in servers:
        await s.start()
    servers[0].values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}  # exactly at target
    servers[1].values = None  # HTTP 500 on every scrape
    try:
        async with replica_set_controller(api, "llm", servers):
            with run_operator():
                await create_scaled_to(api, "llm", 2)

                async def measured_one() -> Any:
                    st = await status(api, "llm")
                    auto = st.get("autoscaling") or {}
                    return st if (auto.get("currentReplicas"), auto.get("measuredReplicas"),
                                  auto.get("readyReplicas")) == (2, 1, 2) else None

                await eventually(measured_one, 20, "a decision on 1 measured of 2 ready")
                assert servers[1].hits > 0
                # Longer than the stabilization window: the failing replica counts as busy.
                t0 = time.monotonic()
                while time.monotonic() - t0 < FAST["scaleDownStabilizationSeconds"] + 3:
                    assert await replicas(api, "llm") == 2
                    await asyncio.sleep(0.2)
                assert conditions(await status(api, "llm"))["ScalingActive"]["status"] == "True"

                # Every scrape failing: no metrics, ScalingActive False, still no scale-down.
                servers[0].values = None

                async def blind() -> Any:
                    st = await status(api, "llm")
                    cond = conditions(st).get("ScalingActive", {})
                    return st if cond.get("reason") == "FailedGetMetrics" else None

                st = await eventually(blind, 20, "ScalingActive False / FailedGetMetrics")
                assert conditions(st)["ScalingActive"]["status"] == "False"
                assert st["autoscaling"]["reason"] == "NoMetrics"
                await asyncio.sleep(2)
                assert await replicas(api, "llm") == 2
                assert events(kube, "llm", "ScaledDown") == []
    finally:
        for s in servers:
            await s.stop()


async def test_scale_down_keeps_the_replicas_holding_batches(kube: Any, api: Api,
                                                             run_operator: Any) -> None:
    # Three idle replicas; the first and the newest hold Batch API requests. The ReplicaSet
    # alone would delete the newest pod; the autoscaler must steer it to the middle one, stop
    # at two replicas while the batches run, and go to minReplicas once they are done.
    servers = [MetricsServer() for _ in range(3)]
    for s in servers:
        await s.start()
    idle = {"kv": 0.0, "waiting": 0.0, "running": 0.0}
    for i, s in enumerate(servers):
        s.values = {**idle, "batch": 40.0 if i in (0, 2) else 0.0}
    try:
        async with replica_set_controller(api, "llm", servers):
            with run_operator():
                await create_scaled_to(api, "llm", 3)

                async def pods() -> set[str]:
                    listed = await api.call("GET", POD_PATH)
                    return {p["metadata"]["name"] for p in listed["items"]}

                async def held_at_two() -> Any:
                    st = await status(api, "llm")
                    auto = st.get("autoscaling") or {}
                    held = (await replicas(api, "llm") == 2
                            and auto.get("reason") == "BatchRequestsPending")
                    return st if held else None

                st = await eventually(held_at_two, 30, "3 -> 2, then held by the batches")
                assert await pods() == {"llm-0", "llm-2"}
                assert st["autoscaling"]["batchReplicas"] == 2
                assert st["autoscaling"]["batchRequestsPending"] == 80
                limited = conditions(st)["ScalingLimited"]
                assert (limited["status"], limited["reason"]) == ("True", "BatchRequestsPending")
                costs = {p["metadata"]["name"]: p["metadata"]["annotations"][POD_DELETION_COST]
                         for p in (await api.call("GET", POD_PATH))["items"]}
                assert costs == {"llm-0": str(BATCH_COST + 40), "llm-2": str(BATCH_COST + 40)}

                # One batch finishes: that replica is the one to go.
                servers[0].values = {**idle, "batch": 0.0}

                async def at_one() -> bool:
                    return await replicas(api, "llm") == 1 and await pods() == {"llm-2"}

                await eventually(at_one, 30, "2 -> 1, keeping the replica with the batch")
    finally:
        for s in servers:
            await s.stop()
    downs = [d["message"].split(":")[0] for d in events(kube, "llm", "ScaledDown")]
    assert downs == ["3 -> 2 replicas", "2 -> 1 replicas"]
    assert_rbac_grants_the_calls_made(kube)


async def test_with_a_shared_batch_volume_one_replica_carries_the_batches(
        kube: Any, api: Api, run_operator: Any) -> None:
    # spec.runtime.batchVolumeClaim: the replicas share one batch folder and a stopping one
    # leaves its batches to the others, so three idle replicas that all hold batches still go
    # down to minReplicas (1), the last one carrying every batch.
    servers = [MetricsServer() for _ in range(3)]
    for s in servers:
        await s.start()
        s.values = {"kv": 0.0, "waiting": 0.0, "running": 0.0, "batch": 40.0}
    try:
        async with replica_set_controller(api, "llm", servers):
            with run_operator():
                await create_scaled_to(api, "llm", 3, runtime={"batchVolumeClaim": "batches"})

                async def at_one() -> bool:
                    auto = (await status(api, "llm")).get("autoscaling") or {}
                    return await replicas(api, "llm") == 1 and auto.get("batchReplicas") == 1

                await eventually(at_one, 30, "3 -> 1 with every replica holding batches")
                await asyncio.sleep(3)  # and it stays: the last replica runs the batches
                assert await replicas(api, "llm") == 1
    finally:
        for s in servers:
            await s.stop()
    assert_rbac_grants_the_calls_made(kube)


def assert_rbac_grants_the_calls_made(kube: Any) -> None:
    """The ClusterRole grants every call the operator made, the pod patches included."""
    with open(ROOT / "manifests" / "operator" / "rbac.yaml", encoding="utf-8") as f:
        role = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "ClusterRole")
    made = operator_calls(kube)
    assert ("", "pods", "patch") in made and made <= granted_calls(role)
