"""Idleness between scrapes: the running/waiting gauges are instants, so a short request that
comes and goes between two scrapes never shows in them, and a deployment serving one request
every couple of minutes looked idle and was scaled to zero (each next request then paid a cold
start). Knative counts every request in its window; here the replica's finished-requests
counter (`argosy:request_success_total`) tells that it served in between.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web
from argosy_operator.autoscaling import AutoscalingPolicy, MetricsSample, ReplicaSample
from argosy_operator.autoscaling.autoscaler import Autoscaler
from argosy_operator.autoscaling.scraper import parse_metrics
from operator_helpers import Api, eventually
from test_timer_kmock import (
    DEP_PATH,
    FAST,
    LLMD_PATH,
    MetricsServer,
    llmd,
    replica_set_controller,
    replicas,
)

POLICY = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4,
                           scale_to_zero_idle_seconds=600)


def quiet(finished: float, name: str | None = "llm-0") -> ReplicaSample:
    """Nothing running or waiting at the scrape; `finished` requests so far."""
    return ReplicaSample(kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0,
                         num_finished=finished, name=name)


def test_requests_served_between_scrapes_keep_a_replica_from_scaling_to_zero() -> None:
    autoscaler = Autoscaler(POLICY)
    last_request = 1800.0
    finished = 0
    for t in range(0, 3000, 5):
        # One short request every 120 s, always finished before the next scrape.
        if 0 < t <= last_request and t % 120 == 0:
            finished += 1
        autoscaler.observe(MetricsSample(t=float(t), replicas=(quiet(finished),)))
        decision = autoscaler.decide(1, now=float(t))
        if decision.desired_replicas == 0:
            break
    # The last request was counted at the scrape at t=1800: zero a whole idle period later.
    assert decision.reason == "ScaleToZero"
    assert last_request + POLICY.scale_to_zero_idle_seconds <= t <= last_request + 605


def test_a_replica_the_counters_cannot_follow_is_judged_by_its_gauges() -> None:
    # Unnamed (argosy fleet, an old trace) or with a steady count: the gauges decide.
    for name in (None, "llm-0"):
        autoscaler = Autoscaler(POLICY)
        for t in range(0, 700, 5):
            autoscaler.observe(MetricsSample(t=float(t), replicas=(quiet(7, name),)))
            decision = autoscaler.decide(1, now=float(t))
        assert decision.desired_replicas == 0
    # A replica not in the previous sample, or whose count changed (it served, or it
    # restarted), was not seen idle in between.
    before = MetricsSample(t=0.0, replicas=(quiet(7, "llm-0"),))
    assert not MetricsSample(t=5.0, replicas=(quiet(7, "llm-1"),)).is_idle_since(before)
    assert not MetricsSample(t=5.0, replicas=(quiet(0, "llm-0"),)).is_idle_since(before)
    assert MetricsSample(t=5.0, replicas=(quiet(7, "llm-0"),)).is_idle_since(before)


def test_a_trace_records_the_finished_requests() -> None:
    import json

    from argosy_operator.autoscaling.simulator import read_trace, simulate

    lines = [json.dumps({"t": t, "replicas": [{"kv": 0, "waiting": 0, "running": 0,
                                               "finished": t // 120, "name": "llm-0"}]})
             for t in range(0, 1800, 5)]
    records = list(simulate(POLICY, read_trace(lines)))
    assert {r["desired"] for r in records} == {1}  # a request every 120 s is not idleness


def test_the_scraper_reads_the_runtimes_finished_requests() -> None:
    from argosy_runtime.outputs import EngineStats
    from argosy_runtime.server.metrics import ServerMetrics

    metrics = ServerMetrics("smollm2-135m")
    metrics.attach_engine(lambda: EngineStats(num_requests_running=0, kv_cache_usage=0.0),
                          lambda: 0, {"block_size": "16"})
    assert parse_metrics(metrics.render().decode()).num_finished == 0.0  # none yet
    metrics.on_finished(0.2, 10, 5, "stop")
    metrics.on_finished(0.3, 10, 5, "length")
    assert parse_metrics(metrics.render().decode()).num_finished == 2.0


class ServingServer(MetricsServer):
    """A replica that finishes one request between every two scrapes while `serving`."""

    def __init__(self) -> None:
        super().__init__()
        self.values = {"kv": 0.0, "waiting": 0.0, "running": 0.0}
        self.serving = True
        self.finished = 0

    async def _metrics(self, request: web.Request) -> web.Response:
        response = await super()._metrics(request)
        if self.serving:
            self.finished += 1
        line = (f'argosy:request_success_total{{model_name="m",finished_reason="stop"}} '
                f"{self.finished}.0\n")
        return web.Response(body=response.body + line.encode(), content_type="text/plain",
                            charset="utf-8")


@pytest.mark.timeout(150)
async def test_the_timer_keeps_a_replica_that_serves_between_scrapes(api: Api,
                                                                     run_operator: Any) -> None:
    server = ServingServer()
    await server.start()
    policy = {**FAST, "minReplicas": 0, "scaleToZeroIdleSeconds": 3}
    try:
        async with replica_set_controller(api, "llm", [server]):
            with run_operator():
                await api.call("POST", LLMD_PATH, llmd("llm", policy), "application/json")
                await eventually(lambda: api.get_or_none(f"{DEP_PATH}/llm"), 10, "Deployment")
                await api.call("PATCH", f"{DEP_PATH}/llm", {"spec": {"replicas": 1}})
                await eventually(lambda: asyncio.sleep(0, result=server.hits >= 2), 20,
                                 "scrapes of the replica")
                # Three times scaleToZeroIdleSeconds with gauges at zero at every scrape.
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3 * policy["scaleToZeroIdleSeconds"]:
                    assert await replicas(api, "llm") == 1
                    await asyncio.sleep(0.2)
                server.serving = False

                async def at_zero() -> bool:
                    return await replicas(api, "llm") == 0

                await eventually(at_zero, 30, "scale to zero once it really is idle")
    finally:
        await server.stop()
