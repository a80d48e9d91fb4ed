"""Review fixes of the autoscaler: each test pins one bug that a user of KEDA/HPA/Knative
would not expect (see the test docstrings)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from argosy_operator.autoscaling import AutoscalingPolicy, MetricsSample, ReplicaSample, timer
from argosy_operator.autoscaling.autoscaler import Autoscaler
from argosy_operator.kube import KubeClient
from operator_helpers import NS, Api
from test_timer_kmock import FAST, LLMD_PATH, conditions, llmd, status

IDLE = ReplicaSample(kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0)
AT_TARGET = ReplicaSample(kv_cache_usage=0.3, num_waiting=4.0, num_running=4.0)  # queue target 4
FAILED = ReplicaSample(ready=True)  # ready, scrape failed
UNREADY = ReplicaSample(ready=False)


def tick(autoscaler: Autoscaler, t: float, current: int, replica: ReplicaSample) -> int:
    autoscaler.observe(MetricsSample(t=t, replicas=(replica,) * current))
    return autoscaler.decide(current, now=t).desired_replicas


def test_a_blind_stretch_restarts_the_scale_down_window() -> None:
    """Samples came, but no replica could be measured for longer than the stable window (every
    scrape failed, or every pod was unready after a node outage): nothing was seen, as in a
    gap without samples. One low sample after it must not scale down at once (8 -> 4 here):
    lower demand has to last a whole scaleDownStabilizationSeconds first."""
    policy = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=8)
    for blind in (FAILED, UNREADY):
        autoscaler = Autoscaler(policy)
        for t in range(0, 605, 5):  # watched for 600 s: 8 replicas, each at target
            assert tick(autoscaler, float(t), 8, AT_TARGET) == 8
        for t in range(605, 1200, 5):  # 10 minutes blind: holds (NoMetrics)
            assert tick(autoscaler, float(t), 8, blind) == 8
        desired = {float(t): tick(autoscaler, float(t), 8, IDLE) for t in range(1200, 1600, 5)}
        down_at = min(t for t, d in desired.items() if d < 8)
        assert down_at >= 1195.0 + policy.scale_down_stabilization_seconds, (blind, down_at)


READINGS = ("kvCacheUtilization", "kvCachePercent", "queueDepth")


async def test_a_timer_that_stops_deciding_removes_its_readings(
        kube: Any, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The printer columns (KV-cache %, Queue) must never show an old reading as the current
    one. A policy the autoscaler refuses (the CRD admitted it) stops the scraping, as a
    refused spec or a missing Deployment do; the last reading stayed in the status, frozen,
    for as long as that lasted."""
    kube.crd_validation = False  # admitted under a CRD without the tolerance bound
    obj = llmd("llm", {**FAST, "tolerance": 1.0})
    await api.call("POST", LLMD_PATH, obj, "application/json")
    await api.call("PATCH", f"{LLMD_PATH}/llm/status", {"status": {
        "kvCacheUtilization": 0.45, "kvCachePercent": 45, "queueDepth": 3.0}})
    body = await api.get_or_none(f"{LLMD_PATH}/llm")
    client = KubeClient(str(kube.url))
    monkeypatch.setattr(timer, "_client", lambda: client)
    try:
        await timer.autoscale(body=body, spec=body["spec"], name="llm", namespace=NS,
                              memo={}, logger=logging.getLogger("test"))
    finally:
        await client.close()
    st = await status(api, "llm")
    assert conditions(st)["ScalingActive"]["reason"] == "InvalidPolicy"
    assert [k for k in READINGS if k in st] == []


def test_a_scrape_interval_longer_than_the_stable_window_still_scales_down() -> None:
    """scrapeIntervalSeconds: 90 with the default stableWindowSeconds: 60 is CRD-valid (a
    long interval to scrape less). Every sample then came more than a stable window after
    the one before, which the decision took for a gap in the samples: the scale-down window
    and the idle clock restarted at every sample, so the deployment never scaled down nor to
    zero. And the window kept no previous sample, so a replica serving between two scrapes
    (its finished-requests counter moving) looked idle."""
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=8,
                               scrape_interval_seconds=90.0)
    autoscaler = Autoscaler(policy)
    current, zero_at = 4, None
    for t in range(0, 3000, 90):
        current = tick(autoscaler, float(t), current, IDLE)
        if current == 0:
            zero_at = t
            break
    assert zero_at is not None and zero_at >= policy.scale_to_zero_idle_seconds

    autoscaler = Autoscaler(policy)
    for i, t in enumerate(range(0, 3000, 90)):  # one request served between every two scrapes
        busy = ReplicaSample(kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0,
                             num_finished=float(i), name="llm-0")
        assert tick(autoscaler, float(t), 1, busy) == 1, t
