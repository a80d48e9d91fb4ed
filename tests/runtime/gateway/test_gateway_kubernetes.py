"""Kubernetes discovery against the emulated API server (the operator tests' emulator:
label selectors on list and watch, resourceVersions, watch resumption)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "operator"))

from argosy_runtime.gateway.backends.kube_api import from_kubeconfig  # noqa: E402
from argosy_runtime.gateway.backends.kubernetes import (  # noqa: E402
    KubernetesDiscovery,
    matches_selector,
)
from argosy_runtime.gateway.backends.pool import ReplicaPool  # noqa: E402
from argosy_runtime.gateway.config import (  # noqa: E402
    GatewayConfig,
    HealthConfig,
    KubernetesBackendConfig,
    ModelRouteConfig,
)
from kube_emulator import ArgosyKubeEmulator  # noqa: E402

NS = "llm"
RESOURCES = {
    "v1/pods": dict(kind="Pod", namespaced=True, subresources={"status"},
                    verbs={"list", "watch", "get", "create", "patch", "delete"}),
    "discovery.k8s.io/v1/endpointslices": dict(
        kind="EndpointSlice", namespaced=True,
        verbs={"list", "watch", "get", "create", "patch", "delete"}),
}
LABEL = "argosy.dev/llmdeployment"


@pytest.fixture
async def kube() -> AsyncIterator[ArgosyKubeEmulator]:
    emulator = ArgosyKubeEmulator()
    async with emulator, kmock.Server(emulator):
        emulator.declare(RESOURCES)
        yield emulator


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def call(http: aiohttp.ClientSession, kube: ArgosyKubeEmulator, method: str, path: str,
               body: Any = None) -> Any:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with http.request(method, f"{kube.url}{path}".replace("//api", "/api"), json=body,
                            headers=headers) as resp:
        assert resp.status < 400, await resp.text()
        return await resp.json()


def pod(name: str, llmd: str, ip: str = "10.1.0.1", port: int = 8000, ready: bool = True) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL: llmd}},
        "spec": {"containers": [{"name": "runtime",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


async def create_pod(http, kube, obj: dict) -> None:
    status = obj.pop("status")
    await call(http, kube, "POST", f"/api/v1/namespaces/{NS}/pods", obj)
    # Like the kubelet: status is written through the status subresource.
    await call(http, kube, "PATCH", f"/api/v1/namespaces/{NS}/pods/{obj['metadata']['name']}/status",
               {"status": status})


async def eventually(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_selector_semantics() -> None:
    labels = {"a": "1", "b": "2"}
    assert matches_selector(labels, "a=1,b==2")
    assert not matches_selector(labels, "a=1,b!=2")
    assert matches_selector(labels, "a in (1, 3), c notin (x)")
    assert not matches_selector(labels, "a notin (1)")
    assert matches_selector(labels, "b,!c") and not matches_selector(labels, "!a")


async def test_pods_list_and_watch(kube, http) -> None:
    await create_pod(http, kube, pod("m-0", "m", ip="10.1.0.1"))
    await create_pod(http, kube, pod("other-0", "other", ip="10.9.9.9"))
    await create_pod(http, kube, pod("m-1", "m", ip="10.1.0.2", ready=False))
    pool = ReplicaPool("m")
    cfg = KubernetesBackendConfig(llmdeployment="m", namespace=NS, api_url=str(kube.url))
    disc = KubernetesDiscovery(pool, cfg, http)
    disc.start()
    try:
        await asyncio.wait_for(disc.synced.wait(), 5)
        assert [r.url for r in pool.replicas] == ["http://10.1.0.1:8000"]
        # A pod becomes Ready -> joins; a new pod with a custom port -> joins; delete -> leaves.
        await call(http, kube, "PATCH", f"/api/v1/namespaces/{NS}/pods/m-1/status",
                   {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        await eventually(lambda: len(pool) == 2)
        await create_pod(http, kube, pod("m-2", "m", ip="10.1.0.3", port=9000))
        await eventually(lambda: pool.get("http://10.1.0.3:9000") is not None)
        await call(http, kube, "DELETE", f"/api/v1/namespaces/{NS}/pods/m-0")
        await eventually(lambda: pool.get("http://10.1.0.1:8000") is None)
        assert sorted(r.url for r in pool.replicas) == ["http://10.1.0.2:8000", "http://10.1.0.3:9000"]
        # Terminating (deletionTimestamp) pods leave rotation before they are gone.
        await call(http, kube, "PATCH", f"/api/v1/namespaces/{NS}/pods/m-2",
                   {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}})
        await eventually(lambda: len(pool) == 1)
    finally:
        await disc.stop()


async def test_endpointslices(kube, http) -> None:
    eps = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "m-abc", "namespace": NS,
                     "labels": {"kubernetes.io/service-name": "m"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.2.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.2.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.2.0.3"], "conditions": {"ready": True, "terminating": True}},
            {"addresses": ["10.2.0.4"]},
        ],
    }
    await call(http, kube, "POST", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", eps)
    pool = ReplicaPool("m")
    cfg = KubernetesBackendConfig(llmdeployment="m", namespace=NS, source="endpointslices",
                                  api_url=str(kube.url))
    disc = KubernetesDiscovery(pool, cfg, http)
    disc.start()
    try:
        await asyncio.wait_for(disc.synced.wait(), 5)
        assert [r.url for r in pool.replicas] == ["http://10.2.0.1:8000", "http://10.2.0.4:8000"]
        await call(http, kube, "PATCH", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/m-abc",
                   {"endpoints": [{"addresses": ["10.2.0.9"], "conditions": {"ready": True}}]})
        await eventually(lambda: [r.url for r in pool.replicas] == ["http://10.2.0.9:8000"])
    finally:
        await disc.stop()


async def test_gateway_routes_to_discovered_pods(kube, http, fake_replicas, gateway, tmp_path,
                                                 monkeypatch) -> None:
    """The whole path: kubeconfig -> discovery -> pool -> proxy, replicas found as pods."""
    a, b = await fake_replicas(2)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emu, cluster: {{server: '{kube.url}'}}}}]\n"
        "users: [{name: t, user: {token: secret-token}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: t}}]\ncurrent-context: emu\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert from_kubeconfig(kubeconfig).headers == {"Authorization": "Bearer secret-token"}
    port_a = int(a.url.rsplit(":", 1)[1])
    await create_pod(http, kube, pod("tiny-0", "tiny", ip="127.0.0.1", port=port_a))
    cfg = GatewayConfig(
        models=(ModelRouteConfig(name="tiny", kubernetes=KubernetesBackendConfig(
            llmdeployment="tiny", namespace=NS)),),
        health=HealthConfig(interval_s=60))
    gw, url = await gateway(cfg)
    await eventually(lambda: len(gw.pools["tiny"]) == 1)
    async with http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
        assert resp.status == 200 and resp.headers["x-argosy-backend"] == a.url
    # Scale-up: a second pod appears and takes traffic.
    port_b = int(b.url.rsplit(":", 1)[1])
    await create_pod(http, kube, pod("tiny-1", "tiny", ip="127.0.0.1", port=port_b))
    await eventually(lambda: len(gw.pools["tiny"]) == 2)
    for _ in range(4):
        async with http.post(f"{url}/v1/completions",
                             json={"model": "tiny", "prompt": "x", "max_tokens": 1}) as resp:
            assert resp.status == 200
    assert len(a.requests) >= 2 and len(b.requests) >= 1
    # The discovery requests carried the kubeconfig's token.
    assert any(r.headers.get("Authorization") == "Bearer secret-token" for r in list(kube))
