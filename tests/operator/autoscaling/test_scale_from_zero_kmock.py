"""Scale from zero across the three parts, in one loop: the real gateway (Kubernetes discovery
+ activation) and the real kopf operator (reconciler + autoscaling timer) against the emulated
API server, with a small fake ReplicaSet controller that turns the Deployment's replicas into
ready pods whose server is a fake replica (tests/runtime/gateway/fake_replica.py).

    client -> gateway: no replica -> hold, stamp argosy.dev/activation-requested
    operator timer: fresh stamp at 0 replicas -> Deployment 0 -> 1 (ScaleFromZero)
    "ReplicaSet": a ready pod -> gateway discovery: in rotation -> the held request is answered
    idle for scaleToZeroIdleSeconds -> 1 -> 0, and the old stamp does not wake it again
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from operator_helpers import NS, Api, eventually

sys.path.insert(0, str(Path(__file__).parents[2] / "runtime" / "gateway"))

from argosy_operator.constants import ANNOTATION_ACTIVATION  # noqa: E402
from argosy_runtime.gateway.activation import ACTIVATION_ANNOTATION  # noqa: E402
from argosy_runtime.gateway.config import (  # noqa: E402
    ActivationConfig,
    GatewayConfig,
    HealthConfig,
    KubernetesBackendConfig,
    ModelRouteConfig,
)
from argosy_runtime.gateway.proxy.app import Gateway, start_gateway  # noqa: E402
from fake_replica import FakeReplica  # noqa: E402

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"

pytestmark = pytest.mark.timeout(120)

AUTOSCALING = {
    "enabled": True, "minReplicas": 0, "maxReplicas": 2, "scrapeIntervalSeconds": 1,
    "stableWindowSeconds": 3, "panicWindowSeconds": 2, "scaleDownStabilizationSeconds": 2,
    "scaleToZeroIdleSeconds": 3,
}


@contextlib.asynccontextmanager
async def replica_set_controller(api: Api, owner: str, server: FakeReplica
                                 ) -> AsyncIterator[list[int]]:
    """Keep pod `owner-0` in step with the Deployment (0 or 1 replicas); yields the replica
    counts it saw, in order of change."""
    port = int(server.url.rsplit(":", 1)[1])
    seen: list[int] = []

    async def loop() -> None:
        exists = False
        while True:
            dep = await api.get_or_none(f"{DEP_PATH}/{owner}")
            want = int(dep["spec"].get("replicas", 1)) if dep else 0
            if not seen or seen[-1] != want:
                seen.append(want)
            if want and not exists:
                await api.call("POST", POD_PATH, {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{owner}-0", "namespace": NS,
                                 "labels": {"argosy.dev/llmdeployment": owner},
                                 "annotations": {"prometheus.io/port": str(port)}},
                    "spec": {"containers": [{"name": "runtime", "image": "x", "ports": [
                        {"name": "http", "containerPort": port}]}]}}, "application/json")
                await api.call("PATCH", f"{POD_PATH}/{owner}-0/status", {"status": {
                    "phase": "Running", "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}]}})
                exists = True
            elif not want and exists:
                await api.call("DELETE", f"{POD_PATH}/{owner}-0")
                exists = False
            await asyncio.sleep(0.1)

    task = asyncio.create_task(loop())
    try:
        yield seen
    finally:
        if task.done():
            task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_request_wakes_a_deployment_at_zero_and_it_goes_back_to_zero(
        kube: Any, api: Api, run_operator: Any) -> None:
    assert ACTIVATION_ANNOTATION == ANNOTATION_ACTIVATION  # spelled twice: one contract
    replica = FakeReplica(model="smollm2")
    await replica.start()
    config = GatewayConfig(
        models=(ModelRouteConfig(
            name="smollm2",
            kubernetes=KubernetesBackendConfig(llmdeployment="llm", namespace=NS,
                                               api_url=str(kube.url)),
            activation=ActivationConfig(timeout_s=60, refresh_s=1)),),
        health=HealthConfig(interval_s=0.5))
    gateway = Gateway(config)
    runner, port = await start_gateway(gateway, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    llmd = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "llm", "namespace": NS},
            "spec": {"model": {"name": "smollm2", "path": "smollm2-135m"},
                     "autoscaling": AUTOSCALING}}
    try:
        async with replica_set_controller(api, "llm", replica) as replica_counts, \
                aiohttp.ClientSession() as http:
            with run_operator():
                await api.call("POST", LLMD_PATH, llmd, "application/json")

                async def reason() -> str | None:
                    obj = await api.get_or_none(f"{LLMD_PATH}/llm")
                    return ((obj or {}).get("status", {}).get("autoscaling") or {}).get("reason")

                async def scaled_to_zero() -> bool:
                    return await reason() == "ScaledToZero"

                await eventually(scaled_to_zero, 20, "the Deployment created at minReplicas 0")
                assert replica_counts == [0] and not gateway.pools["smollm2"].replicas
                async with http.get(f"{url}/ready") as resp:
                    assert resp.status == 200  # stays in its Service: it can wake the model

                # A request at zero: held, the LLMDeployment stamped, the operator wakes it.
                request = asyncio.create_task(http.post(
                    f"{url}/v1/completions", json={"model": "smollm2", "prompt": "Hi"}))
                await asyncio.sleep(0.3)
                assert not request.done() and gateway.activators["smollm2"].held == 1
                async with http.get(f"{url}/metrics") as resp:
                    assert 'argosy:gateway_requests_held{model="smollm2"} 1.0' in await resp.text()
                obj = await api.get_or_none(f"{LLMD_PATH}/llm")
                assert ANNOTATION_ACTIVATION in obj["metadata"]["annotations"]
                resp = await asyncio.wait_for(request, 30)
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-argosy-backend"] == replica.url
                resp.release()
                assert replica_counts == [0, 1] and len(replica.requests) == 1
                events = [r.data for r in list(kube) if r.method == "POST"
                          and "/events" in str(r.url) and isinstance(r.data, dict)
                          and r.data.get("reason") == "ScaledUp"]
                assert [e["message"].split(": ")[:2] for e in events] == [
                    ["0 -> 1 replicas", "ScaleFromZero"]]
                async with http.get(f"{url}/metrics") as m:
                    text = await m.text()
                    assert 'argosy:gateway_activation_wait_seconds_count{model="smollm2"} 1.0' in text

                # Idle: back to zero after scaleToZeroIdleSeconds; the stamp is still younger
                # than its 60 s freshness but older than the scaling, so it wakes nothing.
                await eventually(lambda: asyncio.sleep(0, result=replica_counts[-1] == 0), 20,
                                 "scale to zero when idle")
                await eventually(scaled_to_zero, 10, "status ScaledToZero")
                await asyncio.sleep(3)
                assert replica_counts == [0, 1, 0]
    finally:
        await runner.cleanup()
        await replica.stop()
