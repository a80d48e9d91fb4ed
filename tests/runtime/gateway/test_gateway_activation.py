"""Scale from zero at the gateway: requests for a model with no replica are held until one
comes into rotation (or time out with a 503), against real loopback HTTP (fake replicas)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import kmock
import pytest
from argosy_runtime.gateway.config import (
    ActivationConfig,
    GatewayConfig,
    HealthConfig,
    KubernetesBackendConfig,
    ModelRouteConfig,
)

sys.path.insert(0, str(Path(__file__).parents[2] / "operator"))

from kube_emulator import RESOURCES, ArgosyKubeEmulator  # noqa: E402

BODY = {"model": "tiny", "prompt": "x"}


def config(activation: ActivationConfig | None, backends: tuple[str, ...] = ()) -> GatewayConfig:
    return GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=backends, activation=activation),),
        health=HealthConfig(interval_s=60),
    )


def kubernetes_config(api_url: str, refresh_s: float) -> GatewayConfig:
    """A route for LLMDeployment llm/tiny on the API at `api_url`, with activation."""
    route = ModelRouteConfig(
        name="tiny",
        kubernetes=KubernetesBackendConfig(llmdeployment="tiny", namespace="llm",
                                           api_url=api_url),
        activation=ActivationConfig(timeout_s=30, refresh_s=refresh_s))
    return GatewayConfig(models=(route,), health=HealthConfig(interval_s=60))


async def metric(s: aiohttp.ClientSession, url: str, line: str) -> bool:
    async with s.get(f"{url}/metrics") as resp:
        return line in await resp.text()


async def test_a_held_request_goes_to_the_first_replica_that_comes(fake_replicas, gateway) -> None:
    (replica,) = await fake_replicas(1)
    gw, url = await gateway(config(ActivationConfig(timeout_s=30)))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 200  # a model that can wake up keeps the gateway ready
        async with s.get(f"{url}/v1/models") as resp:  # and is listed, for clients that pick
            assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
        held = [asyncio.create_task(s.post(f"{url}/v1/completions", json=BODY)) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in held) and gw.activators["tiny"].held == 3
        assert await metric(s, url, 'argosy:gateway_requests_held{model="tiny"} 3.0')
        gw.pools["tiny"].add(replica.url)  # what discovery (or the fleet) does once it is ready
        for task in held:
            resp = await asyncio.wait_for(task, 5)
            assert resp.status == 200 and resp.headers["x-argosy-backend"] == replica.url
            resp.release()
        assert len(replica.requests) == 3 and gw.activators["tiny"].held == 0
        assert await metric(s, url, 'argosy:gateway_activation_wait_seconds_count{model="tiny"} 3.0')
        assert await metric(s, url, 'argosy:gateway_requests_held{model="tiny"} 0.0')


async def test_timeout_full_and_disconnect(gateway) -> None:
    gw, url = await gateway(config(ActivationConfig(timeout_s=0.5, max_held=1)))
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(s.post(f"{url}/v1/completions", json=BODY))
        await asyncio.sleep(0.1)
        # Beyond max_held: refused at once instead of piling up connections.
        async with s.post(f"{url}/v1/completions", json=BODY) as resp:
            assert resp.status == 503
            assert "no replica of 'tiny' is available" in (await resp.json())["error"]["message"]
        resp = await first
        assert resp.status == 503 and resp.headers["Retry-After"] == "10"
        error = (await resp.json())["error"]
        assert error["type"] == "service_unavailable_error"
        assert "no replica of 'tiny' became ready within 0.5 s" in error["message"]
        assert await metric(s, url, 'argosy:gateway_activation_timeouts_total{model="tiny"} 1.0')
        # A client that gives up while held simply stops waiting.
        with pytest.raises(asyncio.TimeoutError):
            await s.post(f"{url}/v1/completions", json=BODY, timeout=aiohttp.ClientTimeout(0.2))
        await asyncio.sleep(0.1)
        assert gw.activators["tiny"].held == 0


async def test_without_activation_or_with_busy_replicas_nothing_is_held(
        fake_replicas, gateway) -> None:
    # No activation: 503 at once, and /ready says so.
    (busy,) = await fake_replicas(1, rate_limited=30)
    gw, url = await gateway(GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=("http://127.0.0.1:9",)),),
        health=HealthConfig(interval_s=60)))
    async with aiohttp.ClientSession() as s:
        gw.pools["tiny"].replicas[0].healthy = False
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 503
        async with s.post(f"{url}/v1/completions", json=BODY) as resp:
            assert resp.status == 503
    # With activation, a replica that is healthy but full (Retry-After) is busy, not gone: the
    # client gets the 429 and its Retry-After, not a hold.
    gw, url = await gateway(config(ActivationConfig(timeout_s=30), backends=(busy.url,)))
    async with aiohttp.ClientSession() as s:
        # The first 429 is the replica's; the second the gateway's own, while it cools down.
        for _ in range(2):
            async with s.post(f"{url}/v1/completions", json=BODY,
                               timeout=aiohttp.ClientTimeout(5)) as resp:
                assert resp.status == 429 and "Retry-After" in resp.headers
    assert gw.activators["tiny"].held == 0


@pytest.fixture
async def kube() -> AsyncIterator[ArgosyKubeEmulator]:
    """An emulated API server with pods only (no LLMDeployment resource: patches get 404)."""
    emulator = ArgosyKubeEmulator()
    async with emulator, kmock.Server(emulator):
        emulator.declare({"v1/pods": dict(kind="Pod", namespaced=True, subresources={"status"},
                                          verbs={"list", "watch", "get", "create", "patch"})})
        yield emulator


async def test_kubernetes_route_stamps_its_llmdeployment(kube, fake_replicas, gateway) -> None:
    """The signal is a merge patch of the annotation; when the API refuses it, the request
    still waits and the stamp is retried every refresh_s."""
    (replica,) = await fake_replicas(1)
    gw, url = await gateway(kubernetes_config(str(kube.url), refresh_s=0.3))

    def patches() -> list:
        return [r for r in list(kube) if r.method == "PATCH"
                and str(r.url).endswith("/apis/argosy.dev/v1alpha1/namespaces/llm/"
                                        "llmdeployments/tiny")]

    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(f"{url}/v1/completions", json=BODY))
        await asyncio.sleep(1.0)
        sent = patches()
        assert len(sent) >= 2 and not task.done()  # each a 404 here, so retried
        stamp = sent[0].data["metadata"]["annotations"]["argosy.dev/activation-requested"]
        assert stamp.endswith("Z") and len(stamp) == len("2026-12-03T18:00:00Z")
        assert sent[0].headers["Content-Type"] == "application/merge-patch+json"
        gw.pools["tiny"].add(replica.url)
        resp = await asyncio.wait_for(task, 5)
        assert resp.status == 200
        resp.release()
        count = len(patches())
        await asyncio.sleep(0.8)
        assert len(patches()) == count  # nothing held: no more stamps


@pytest.fixture
async def kube_with_llmd() -> AsyncIterator[tuple[ArgosyKubeEmulator, aiohttp.ClientSession]]:
    """An emulated API server that serves LLMDeployments (the CRD's schema applies)."""
    emulator = ArgosyKubeEmulator()
    async with emulator, kmock.Server(emulator), aiohttp.ClientSession() as session:
        emulator.declare({k: v for k, v in RESOURCES.items() if "llmdeployments" in k})
        yield emulator, session


LLMD = "/apis/argosy.dev/v1alpha1/namespaces/llm/llmdeployments"


async def test_a_deployment_nothing_will_scale_up_answers_at_once(kube_with_llmd, gateway
                                                                  ) -> None:
    """At spec.replicas 0 without autoscaling the stamp wakes nothing: the held request gets a
    503 saying why as soon as the patch comes back, not after timeout_s; once the spec can
    bring a replica, requests are held again."""
    kube, api = kube_with_llmd
    body = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "tiny", "namespace": "llm"},
            "spec": {"model": {"name": "tiny", "path": "/m/tiny"}, "replicas": 0}}
    async with api.post(f"{kube.url}{LLMD}", json=body) as resp:
        assert resp.status < 300, await resp.text()
    gw, url = await gateway(kubernetes_config(str(kube.url), refresh_s=0.5))
    async with aiohttp.ClientSession() as s:
        started = asyncio.get_running_loop().time()
        async with s.post(f"{url}/v1/completions", json=BODY) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "60"
            message = (await resp.json())["error"]["message"]
        assert asyncio.get_running_loop().time() - started < 5  # not the 30 s timeout
        assert "LLMDeployment llm/tiny is at spec.replicas 0 without autoscaling" in message
        assert not await metric(s, url, 'argosy:gateway_activation_timeouts_total{model="tiny"}')
        # Autoscaling turned on: the next request (after refresh_s) is held again.
        patch = {"spec": {"autoscaling": {"enabled": True, "minReplicas": 0}}}
        async with api.patch(f"{kube.url}{LLMD}/tiny", json=patch,
                             headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status == 200, await resp.text()
        await asyncio.sleep(0.6)
        task = asyncio.create_task(s.post(f"{url}/v1/completions", json=BODY))
        await asyncio.sleep(1.0)
        assert not task.done() and gw.activators["tiny"].held == 1
        task.cancel()


async def test_held_requests_go_on_in_arrival_order_each_once(fake_replicas, gateway) -> None:
    """Held requests are released first come, first served: each woke on its own 50 ms poll,
    so a later arrival whose poll came first went ahead of earlier ones."""
    (replica,) = await fake_replicas(1)
    gw, url = await gateway(config(ActivationConfig(timeout_s=60)))
    activator = gw.activators["tiny"]
    async with aiohttp.ClientSession() as s:
        held = []
        for i in range(8):  # arrivals spread over more than one poll interval
            held.append(asyncio.create_task(
                s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"p{i}"})))
            for _ in range(200):  # this one is held before the next is sent
                if activator.held == i + 1:
                    break
                await asyncio.sleep(0.01)
            assert activator.held == i + 1
            await asyncio.sleep(0.013)
        gw.pools["tiny"].add(replica.url)
        for task in held:
            resp = await asyncio.wait_for(task, 30)
            assert resp.status == 200
            resp.release()
    assert [r["prompt"] for r in replica.requests] == [f"p{i}" for i in range(8)]
    assert activator.held == 0
