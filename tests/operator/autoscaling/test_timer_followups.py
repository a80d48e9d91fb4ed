"""The autoscaling timer (the real kopf operator against the emulated API) when the API server
cannot be reached, and when someone scales the Deployment by hand while a tick scrapes."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web
from argosy_operator import handlers
from operator_helpers import Api, eventually
from test_timer_kmock import (
    DEP_PATH,
    FAST,
    LLMD_PATH,
    MetricsServer,
    create_scaled_to,
    events,
    llmd,
    make_pod,
    replica_set_controller,
    replicas,
    status,
)

pytestmark = pytest.mark.timeout(150)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_dropped_api_connection_does_not_stop_autoscaling(api: Api,
                                                                  run_operator: Any) -> None:
    """Connection errors (not HTTP error answers) must not escape a tick: kopf would retry
    the timer only after its 60 s backoff, and autoscale nothing meanwhile."""
    servers = [MetricsServer() for _ in range(4)]
    for s in servers:
        await s.start()
        s.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}  # at target
    try:
        async with replica_set_controller(api, "llm", servers):
            with run_operator():
                await create_scaled_to(api, "llm", 1)

                async def measured() -> Any:
                    return "queueDepth" in await status(api, "llm")

                await eventually(measured, 20, "the autoscaler's first status")
                # The operator's own client loses the API server (kopf's watches keep theirs).
                client = handlers.get_client()
                server, client.server = client.server, f"http://127.0.0.1:{_closed_port()}"
                first_miss = servers[0].hits
                await eventually(lambda: asyncio.sleep(0, result=servers[0].hits == first_miss),
                                 5, "a tick that fails")
                await asyncio.sleep(2.5)  # a few ticks against the closed port
                for s in servers:  # a spike, while the API server is still unreachable
                    s.values = {"kv": 0.6, "waiting": 16.0, "running": 8.0}
                client.server = server

                async def scaled_up() -> bool:
                    return (await replicas(api, "llm") or 0) > 1

                await eventually(scaled_up, 10, "a scale-up soon after the connection is back")
    finally:
        for s in servers:
            await s.stop()


class HandScaledServer(MetricsServer):
    """A replica whose next scrape first runs `during_scrape` (a hand scale, a status write):
    a change to the Deployment that lands between the timer's read and its write."""

    def __init__(self, during_scrape: Any) -> None:
        super().__init__()
        self.during_scrape = during_scrape
        self.armed = False

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.armed:
            self.armed = False
            await self.during_scrape()
        return await super()._metrics(request)


@pytest.mark.parametrize("change", ["kubectl scale", "status write"])
async def test_a_hand_scale_during_the_scrape_is_not_overwritten(kube: Any, api: Api,
                                                                 run_operator: Any,
                                                                 change: str) -> None:
    """2 replicas with 6 waiting requests each (target 4): the timer decides 2 -> 3. A hand
    scale to 4 made while it scrapes wins (the next tick decides from 4); a mere status write
    to the Deployment (its controller's) still lets the scale-up through."""
    async def hand_scale() -> None:
        await api.call("PATCH", f"{DEP_PATH}/llm", {"spec": {"replicas": 4}})

    async def status_write() -> None:
        await api.call("PATCH", f"{DEP_PATH}/llm/status", {"status": {"replicas": 2}})

    servers = [HandScaledServer(hand_scale if change == "kubectl scale" else status_write),
               MetricsServer()]
    for s in servers:
        await s.start()
        s.values = {"kv": 0.3, "waiting": 6.0, "running": 4.0}
    policy = {**FAST, "scaleDownStabilizationSeconds": 120}
    try:
        with run_operator():
            await api.call("POST", LLMD_PATH, llmd("llm", policy), "application/json")
            await eventually(lambda: api.get_or_none(f"{DEP_PATH}/llm"), 10, "Deployment")
            await api.call("PATCH", f"{DEP_PATH}/llm", {"spec": {"replicas": 2}})
            await asyncio.sleep(1.5)  # no tick still holds the Deployment read before that
            servers[0].armed = True
            for i, s in enumerate(servers):
                await make_pod(api, "llm", i, s.port)
            await eventually(lambda: asyncio.sleep(0, result=not servers[0].armed), 10,
                             "the first scrape")
            if change == "kubectl scale":
                await asyncio.sleep(3)  # a few ticks: none goes back to 3
                assert await replicas(api, "llm") == 4
                ups = [e["message"] for e in events(kube, "llm", "ScaledUp")]
                assert not any(m.startswith("2 -> 3") for m in ups), ups
            else:
                async def at_three() -> bool:
                    return await replicas(api, "llm") == 3

                await eventually(at_three, 10, "the scale-up 2 -> 3")
    finally:
        for s in servers:
            await s.stop()

