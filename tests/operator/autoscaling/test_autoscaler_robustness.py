"""Robustness of the autoscaler against what a cluster really serves it: absurd metric values,
pods that are not replicas any more, an LLMDeployment deleted while a tick is in flight, a
status write the API server refuses, autoscaling switched off, the edge of a stabilization
window.

The pure decision is called directly; the timer runs as the real kopf operator against the
emulated API server (tests/operator/kube_emulator.py), as in test_timer_kmock.py, whose
helpers (loopback /metrics servers, a fake ReplicaSet controller) it reuses.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kmock
import pytest
from argosy_operator.autoscaling import (
    AutoscalingPolicy,
    DecisionState,
    MetricsSample,
    ReplicaSample,
    decide,
)
from argosy_operator.autoscaling.status import autoscaling_status
from operator_helpers import Api, eventually
from test_timer_kmock import (
    DEP_PATH,
    LLMD_PATH,
    POD_PATH,
    MetricsServer,
    llmd,
    make_pod,
    replica_set_controller,
    replicas,
    status,
)

pytestmark = pytest.mark.timeout(150)

POLICY = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=4,
                           target_queue_depth=0.5)


ONE_TO_TWO = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "scrapeIntervalSeconds": 1,
              "stableWindowSeconds": 3, "panicWindowSeconds": 2}


async def create_at_one_replica(api: Api, spec: dict[str, Any]) -> None:
    """Create the LLMDeployment "llm" with this autoscaling spec; its Deployment at 1."""
    await api.call("POST", LLMD_PATH, llmd("llm", spec), "application/json")
    await eventually(lambda: api.get_or_none(f"{DEP_PATH}/llm"), 10, "Deployment")
    await api.call("PATCH", f"{DEP_PATH}/llm", {"spec": {"replicas": 1}})


async def measured(api: Api) -> bool:
    """Has the autoscaler written its first reading?"""
    return "queueDepth" in await status(api, "llm")


@pytest.mark.parametrize("waiting", [1e308, 1e30])
def test_a_huge_queue_depth_scales_to_max_replicas_with_a_serialisable_status(
        waiting: float) -> None:
    # Each value is finite (the scraper accepts it), but summed over replicas and divided by
    # the target it overflows to inf (1e308) or to a replica count no int32 holds (1e30).
    replica = ReplicaSample(kv_cache_usage=0.5, num_waiting=waiting, num_running=1.0)
    sample = MetricsSample(t=10.0, replicas=(replica, replica))
    decision = decide(POLICY, 2, [sample], DecisionState(), now=10.0)
    assert decision.desired_replicas == 4  # x2 per decision, capped at maxReplicas
    # The status goes to the API server as JSON: no Infinity, no integer beyond int32.
    text = json.dumps(autoscaling_status(decision, None), allow_nan=False)
    recommendation = json.loads(text)["autoscaling"]["recommendation"]
    assert POLICY.max_replicas <= recommendation <= 2**31 - 1


async def test_evicted_pods_are_not_replicas(api: Api, run_operator: Any) -> None:
    # An evicted pod stays (phase Failed, not Ready) until it is garbage-collected, but its
    # ReplicaSet already replaced it. Counted as a not-ready replica it looked busy forever
    # and held off the scale to zero of an idle deployment.
    server = MetricsServer()
    await server.start()
    server.values = {"kv": 0.0, "waiting": 0.0, "running": 0.0}
    spec = {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "scrapeIntervalSeconds": 1,
            "stableWindowSeconds": 2, "panicWindowSeconds": 1,
            "scaleDownStabilizationSeconds": 1, "scaleToZeroIdleSeconds": 2}
    try:
        async with replica_set_controller(api, "llm", [server]):
            with run_operator():
                await create_at_one_replica(api, spec)
                await make_pod(api, "llm", 9, server.port)
                await api.call("PATCH", f"{POD_PATH}/llm-9/status", {"status": {
                    "phase": "Failed", "reason": "Evicted", "podIP": None,
                    "conditions": [{"type": "Ready", "status": "False"}]}})

                async def at_zero() -> bool:
                    return await replicas(api, "llm") == 0

                await eventually(at_zero, 20, "the idle deployment to scale to zero")
    finally:
        await server.stop()


class SlowMetricsServer(MetricsServer):
    """Answers /metrics after `delay` seconds; `asked` is set when a scrape arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0
        self.asked = asyncio.Event()

    async def _metrics(self, request: Any) -> Any:
        self.asked.set()
        await asyncio.sleep(self.delay)
        return await super()._metrics(request)


async def test_deleting_the_llmdeployment_during_a_tick(api: Api, run_operator: Any) -> None:
    # kopf holds the object (its finalizer) until the timer tick in flight has finished; it
    # then must go within seconds, not after kopf's default 60 s cancellation polling.
    server = SlowMetricsServer()
    await server.start()
    server.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
    try:
        async with replica_set_controller(api, "llm", [server]):
            with run_operator() as runner:
                await create_at_one_replica(api, ONE_TO_TWO)
                await eventually(lambda: measured(api), 20, "the autoscaler's first status")
                server.delay = 0.3  # under the scrape timeout (0.5 s at a 1 s interval)
                server.asked.clear()
                await asyncio.wait_for(server.asked.wait(), 10)
                await api.call("DELETE", f"{LLMD_PATH}/llm")

                async def gone() -> bool:
                    return await api.get_or_none(f"{LLMD_PATH}/llm") is None

                await eventually(gone, 10, "the LLMDeployment to go")
    finally:
        await server.stop()
    assert "failed with an exception" not in runner.output, runner.output


async def test_a_refused_status_write_does_not_stall_the_autoscaler(
        kube: Any, api: Api, run_operator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A status write the API server refuses (a 500 here; an exhausted conflict retry alike)
    # must not fail the timer tick: kopf would retry a failed timer only after its 60 s
    # backoff, and no replica would be added meanwhile however high the load.
    servers = [MetricsServer() for _ in range(2)]
    for s in servers:
        await s.start()
        s.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
    refusing = [False]
    prepare = kube._prepare_patch

    def refuse_status(request: Any) -> Any:
        if request.subresource == "status" and refusing[0]:
            raise kmock.KubernetesError(status=500, reason="InternalError",
                                        message="etcdserver: request timed out")
        return prepare(request)

    monkeypatch.setattr(kube, "_prepare_patch", refuse_status)
    try:
        async with replica_set_controller(api, "llm", servers):
            with run_operator() as runner:
                await create_at_one_replica(api, ONE_TO_TWO)
                await eventually(lambda: measured(api), 20, "the autoscaler's first status")
                refusing[0] = True
                servers[0].values = {"kv": 0.3, "waiting": 3.0, "running": 4.0}  # new status
                await asyncio.sleep(2.5)  # ticks whose status write is refused
                refusing[0] = False
                servers[0].values = {"kv": 0.9, "waiting": 40.0, "running": 8.0}

                async def at_two() -> bool:
                    return await replicas(api, "llm") == 2

                await eventually(at_two, 10, "the scale-up after the refused status writes")
    finally:
        for s in servers:
            await s.stop()
    assert "failed with an exception" not in runner.output, runner.output


@pytest.mark.parametrize("up_seconds", [0.0, 10.0])
def test_the_scale_down_window_edge_does_not_depend_on_the_scale_up_window(
        up_seconds: float) -> None:
    # Windows hold the last W seconds, (now - W, now], as the metric windows do. A
    # recommendation exactly scaleDownStabilizationSeconds old was dropped when the
    # scale-up window was shorter, but still held the scale-down when it was longer.
    policy = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=4,
                               stable_window_seconds=5.0, panic_window_seconds=5.0,
                               scale_up_stabilization_seconds=up_seconds,
                               scale_down_stabilization_seconds=5.0)
    at_target = ReplicaSample(kv_cache_usage=0.0, num_waiting=4.0, num_running=4.0)
    idle = ReplicaSample(kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0)
    busy = MetricsSample(t=0.0, replicas=(at_target,) * 4)
    first = decide(policy, 4, [busy], DecisionState(), now=0.0)
    assert first.desired_replicas == 4
    quiet = MetricsSample(t=5.0, replicas=(idle,) * 4)
    second = decide(policy, 4, [busy, quiet], first.state, now=5.0)
    assert (second.reason, second.desired_replicas) == ("ScaleDown", 2)  # halving at most


async def test_disabling_autoscaling_clears_the_autoscalers_status(api: Api,
                                                                  run_operator: Any) -> None:
    # With enabled: false the timer no longer runs, so nothing refreshed the autoscaler's
    # part of the status: `kubectl get llmd` showed the last KV-cache % and queue forever,
    # and ScalingActive stayed True.
    server = MetricsServer()
    await server.start()
    server.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
    try:
        async with replica_set_controller(api, "llm", [server]):
            with run_operator():
                await create_at_one_replica(api, ONE_TO_TWO)
                await eventually(lambda: measured(api), 20, "the autoscaler's first status")
                await api.call("PATCH", f"{LLMD_PATH}/llm",
                               {"spec": {"autoscaling": {"enabled": False}}})

                async def cleared() -> Any:
                    st = await status(api, "llm")
                    active = next((c for c in st.get("conditions") or []
                                   if c["type"] == "ScalingActive"), {})
                    return st if active.get("reason") == "AutoscalingDisabled" else None

                st = await eventually(cleared, 15, "ScalingActive False / AutoscalingDisabled")
                assert not {"desiredReplicas", "kvCacheUtilization", "kvCachePercent",
                            "queueDepth", "autoscaling"} & set(st)
                limited = next(c for c in st["conditions"] if c["type"] == "ScalingLimited")
                assert limited["status"] == "False"
                # for the generation that switched it off, as every other condition says
                generation = (await api.call("GET", f"{LLMD_PATH}/llm"))["metadata"]["generation"]
                assert {c["observedGeneration"] for c in st["conditions"]
                        if c["type"] in ("ScalingActive", "ScalingLimited")} == {generation}
    finally:
        await server.stop()

