"""The operator's small API client, against the emulated API server."""

from __future__ import annotations

import base64
import pathlib
import ssl
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from argosy_operator.kube import (
    DEPLOYMENTS,
    DISCOVERY_CACHE_SECONDS,
    LLMDEPLOYMENTS,
    PDBS,
    SERVICEMONITORS,
    ApiError,
    KubeClient,
    Resource,
    ssl_context,
)
from argosy_operator.workload import deployment_replicas, scale_deployment

CA_BUNDLE = pathlib.Path("/etc/ssl/certs/ca-certificates.crt")


def test_paths() -> None:
    assert DEPLOYMENTS.path("ml", "a") == "/apis/apps/v1/namespaces/ml/deployments/a"
    assert LLMDEPLOYMENTS.path("ml", "a", "status") == \
        "/apis/argosy.dev/v1alpha1/namespaces/ml/llmdeployments/a/status"
    assert Resource("", "v1", "pods").path("ml") == "/api/v1/namespaces/ml/pods"
    assert Resource("", "v1", "namespaces", namespaced=False).path("ignored", "x") == \
        "/api/v1/namespaces/x"


def test_ssl_context_from_connection_info() -> None:
    assert ssl_context(kopf.ConnectionInfo(server="http://127.0.0.1:1")) is False
    assert ssl_context(kopf.ConnectionInfo(server="https://k", insecure=True)) is False
    if not CA_BUNDLE.exists():
        pytest.skip("no system CA bundle to build a kubeconfig-style ca_data from")
    pem = CA_BUNDLE.read_text()
    first = pem[: pem.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    for ca_data in (first, base64.b64encode(first.encode()).decode()):  # PEM or base64 PEM
        ctx = ssl_context(kopf.ConnectionInfo(server="https://k", ca_data=ca_data))
        assert isinstance(ctx, ssl.SSLContext)
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.cert_store_stats()["x509_ca"] >= 1


async def test_verbs_against_the_emulator(kube: Any) -> None:
    client = KubeClient(str(kube.url), headers={"Authorization": "Bearer t"})
    try:
        assert await client.get(DEPLOYMENTS, "ml", "a") is None
        body = {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "a", "namespace": "ml", "labels": {"x": "1"}},
                "spec": {"replicas": 1}}
        created = await client.create(DEPLOYMENTS, "ml", body)
        assert created["metadata"]["uid"]
        with pytest.raises(ApiError) as err:
            await client.create(DEPLOYMENTS, "ml", body)
        assert err.value.status == 409
        await scale_deployment(client, "ml", "a", 4)
        assert deployment_replicas(await client.get(DEPLOYMENTS, "ml", "a")) == 4
        assert [d["metadata"]["name"] for d in await client.list(
            DEPLOYMENTS, "ml", label_selector="x=1")] == ["a"]
        assert await client.list(DEPLOYMENTS, "ml", label_selector="x=2") == []
        assert await client.has_resource(DEPLOYMENTS)
        assert await client.delete(DEPLOYMENTS, "ml", "a") is True
        assert await client.delete(DEPLOYMENTS, "ml", "a") is False
        with pytest.raises(ValueError, match="replicas"):
            await scale_deployment(client, "ml", "a", -1)
    finally:
        await client.close()
    requests = [r for r in list(kube) if r.resource is not None]
    assert all(r.headers.get("User-Agent") == "argosy-operator/0.1.0" for r in requests)


@pytest.mark.no_servicemonitor
async def test_has_resource_is_false_without_the_crd(kube: Any) -> None:
    client = KubeClient(str(kube.url))
    try:
        assert not await client.has_resource(SERVICEMONITORS)
    finally:
        await client.close()


def _discovery_gets(kube: Any, path: str) -> int:
    return sum(1 for r in list(kube) if r.method == "GET" and r.url.path == path)


async def test_discovery_answers_are_reused_until_they_expire(
        kube: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request per group-version document while the answer is younger than
    DISCOVERY_CACHE_SECONDS (other resources of the same group-version included); after that,
    or with `fresh`, the API server is asked again."""
    from argosy_operator import kube as kube_module

    now = [1000.0]
    monkeypatch.setattr(kube_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    pdbs_path = "/apis/policy/v1"
    client = KubeClient(str(kube.url))
    try:
        for _ in range(5):
            assert await client.has_resource(SERVICEMONITORS)
            assert await client.has_resource(PDBS)
        assert not await client.has_resource(Resource("policy", "v1", "nonesuch"))
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 1
        assert _discovery_gets(kube, pdbs_path) == 1

        now[0] += DISCOVERY_CACHE_SECONDS - 1
        assert await client.has_resource(SERVICEMONITORS)
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 1
        now[0] += 1  # expired
        assert await client.has_resource(SERVICEMONITORS)
        assert await client.has_resource(SERVICEMONITORS)
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 2

        assert await client.has_resource(SERVICEMONITORS, fresh=True)
        assert await client.has_resource(SERVICEMONITORS)  # the fresh answer, reused
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 3
        client.forget_discovery(SERVICEMONITORS)
        assert await client.has_resource(SERVICEMONITORS)
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 4
        assert _discovery_gets(kube, pdbs_path) == 1
    finally:
        await client.close()


@pytest.mark.no_servicemonitor
async def test_an_absent_api_is_cached_and_an_error_is_not(
        kube: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """404 (the CRD not installed) is an answer and is reused; a 500 or a proxy's 503 raises
    and is not kept: the next call asks again."""
    import aiohttp.web
    import kmock

    client = KubeClient(str(kube.url))
    try:
        assert not await client.has_resource(SERVICEMONITORS)
        assert not await client.has_resource(SERVICEMONITORS)
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 1

        handle, failures = kube._handle, [1]

        async def failing_once(request: Any) -> Any:
            if request.url.path == PDBS.discovery_path and failures:
                failures.pop()
                raise kmock.KubernetesError(status=500, reason="InternalError",
                                            message="etcdserver: leader changed")
            return await handle(request)

        monkeypatch.setattr(kube, "_handle", failing_once)
        with pytest.raises(ApiError) as err:
            await client.has_resource(PDBS)
        assert err.value.status == 500
        assert await client.has_resource(PDBS)
        assert await client.has_resource(PDBS)
        assert _discovery_gets(kube, PDBS.discovery_path) == 2

        # A proxy's plain-text 503 is an error too, not "absent" (cached, a reconcile took it
        # for a missing CRD and left the ServiceMonitor as it was).
        async def proxy_503_once(request: Any) -> Any:
            if request.url.path == SERVICEMONITORS.discovery_path and failures:
                failures.pop()
                return aiohttp.web.Response(status=503, text="upstream connect error")
            return await handle(request)

        failures.append(1)
        client.forget_discovery(SERVICEMONITORS)
        monkeypatch.setattr(kube, "_handle", proxy_503_once)
        with pytest.raises(ApiError) as err:
            await client.has_resource(SERVICEMONITORS)
        assert err.value.status == 503
        assert not await client.has_resource(SERVICEMONITORS)  # asked again: a 404
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 3
    finally:
        await client.close()


@pytest.mark.no_servicemonitor
async def test_a_late_answer_does_not_replace_a_fresher_one(
        kube: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconcile's discovery request answered "absent" but slow to arrive, the CRD
    installed and seen by a fresh request meanwhile: the cache keeps the fresher answer."""
    import asyncio

    from kube_emulator import SERVICEMONITOR_CRD

    handle, gate, held = kube._handle, asyncio.Event(), []

    async def holding_the_first(request: Any) -> Any:
        try:
            return await handle(request)  # raises the 404 while the CRD is absent
        finally:
            if request.url.path == SERVICEMONITORS.discovery_path and not held:
                held.append(request)
                await gate.wait()

    monkeypatch.setattr(kube, "_handle", holding_the_first)
    client = KubeClient(str(kube.url))
    try:
        slow = asyncio.create_task(client.has_resource(SERVICEMONITORS))
        for _ in range(500):
            if held:
                break
            await asyncio.sleep(0.01)
        await client.create(Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions",
                                     namespaced=False), "", SERVICEMONITOR_CRD)
        assert await client.has_resource(SERVICEMONITORS, fresh=True)
        gate.set()
        assert not await slow
        assert await client.has_resource(SERVICEMONITORS)
        assert _discovery_gets(kube, SERVICEMONITORS.discovery_path) == 2
    finally:
        await client.close()


async def test_an_answer_that_is_not_json_is_an_api_error() -> None:
    """A proxy between the operator and the API server answers in plain text (a 502, 503 or
    504 while the API server restarts): an ApiError with the start of the body, like any
    error status, never a JSONDecodeError (a ValueError, which the reconcile took for a
    refused spec). A 2xx whose body is not JSON is an ApiError too."""
    import aiohttp.web

    answers = [(503, "upstream connect error or disconnect/reset before headers"),
               (502, "<html>" + "x" * 2000 + "</html>"), (200, "<html>login</html>")]

    async def answer(_request: Any) -> aiohttp.web.Response:
        status, text = answers.pop(0)
        return aiohttp.web.Response(status=status, text=text)

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = KubeClient(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(ApiError) as err:
            await client.get(LLMDEPLOYMENTS, "ml", "chat")
        assert (err.value.status, err.value.reason) == (503, "Service Unavailable")
        assert err.value.message == "upstream connect error or disconnect/reset before headers"
        with pytest.raises(ApiError) as err:
            await client.list(DEPLOYMENTS, "ml")
        assert err.value.status == 502 and len(err.value.message) == 500
        with pytest.raises(ApiError) as err:
            await client.get(LLMDEPLOYMENTS, "ml", "chat")
        assert (err.value.status, err.value.reason) == (200, "InvalidResponse")
        assert "login" in err.value.message
    finally:
        await client.close()
        await runner.cleanup()
