"""The operator's small API client, against the emulated API server."""

from __future__ import annotations

import base64
import pathlib
import ssl
from typing import Any

import kopf
import pytest
from argosy_operator.kube import (
    DEPLOYMENTS,
    LLMDEPLOYMENTS,
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
