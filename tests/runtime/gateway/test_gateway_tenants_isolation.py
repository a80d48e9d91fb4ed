"""Tenants isolate what replicas store: two tenants through one gateway in front of two
replicas running the real Batch API routes (no model). A tenant lists only its own files and
batches, and another tenant's id is the same 404 as an unknown one on every verb; a client
cannot choose its owner with the X-Argosy-Owner header. Stored Responses through a real
`argosy serve` replica: test_gateway_tenants_e2e.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from argosy_runtime.gateway.config import (
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    TenantConfig,
)
from batch_replica import BatchReplica, start_batch_replica

KEY_A, KEY_B = "sk-isolation-a", "sk-isolation-b"
LINE = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                   "body": {"model": "tiny", "prompt": "hi"}}).encode() + b"\n"


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """`await replica()` -> the URL of a replica with the real Batch API routes (its batches'
    requests get the app's 404: there is no model, which these tests do not need)."""
    started: list[BatchReplica] = []

    async def make() -> str:
        started.append(await start_batch_replica(tmp_path / f"replica{len(started)}",
                                                 run_batches=True))
        return started[-1].url

    yield make
    for r in started:
        await r.stop()


def _config(urls: list[str], tenants: bool = True) -> GatewayConfig:
    return GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=tuple(urls)),),
        tenants=(TenantConfig(name="team-a", api_keys=(KEY_A,)),
                 TenantConfig(name="team-b", api_keys=(KEY_B,))) if tenants else (),
        health=HealthConfig(interval_s=60))


def _auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


async def _upload(s: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", LINE, filename="in.jsonl", content_type="application/jsonl")
    async with s.post(f"{url}/v1/files", data=form, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _finished(s: aiohttp.ClientSession, url: str, batch_id: str,
                    headers: dict[str, str]) -> dict:
    for _ in range(200):
        async with s.get(f"{url}/v1/batches/{batch_id}", headers=headers) as resp:
            batch = await resp.json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not finish: {batch}")


async def _ids(s: aiohttp.ClientSession, url: str, kind: str, headers: dict[str, str]) -> set:
    async with s.get(f"{url}/v1/{kind}", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return {item["id"] for item in (await resp.json())["data"]}


async def test_a_tenant_sees_only_its_own_files_and_batches(replica, gateway) -> None:
    urls = [await replica(), await replica()]
    _, url = await gateway(_config(urls))
    a, b = _auth(KEY_A), _auth(KEY_B)
    # B claims to be A: the gateway sets the owner itself, whatever the client sends.
    b_as_a = _auth(KEY_B, **{"X-Argosy-Owner": "team-a"})
    async with aiohttp.ClientSession() as s:
        a_file = (await _upload(s, url, a))["id"]
        b_file = (await _upload(s, url, b_as_a))["id"]
        assert "owner" not in await _upload(s, url, a)  # objects keep OpenAI's shape
        async with s.post(f"{url}/v1/batches", headers=a, json={
                "input_file_id": a_file, "endpoint": "/v1/completions",
                "completion_window": "24h"}) as resp:
            assert resp.status == 200, await resp.text()
            a_batch = (await resp.json())["id"]
        done = await _finished(s, url, a_batch, a)
        a_error_file = done["error_file_id"]  # the batch's results belong to A too
        assert a_error_file is not None

        for headers in (b, b_as_a):
            files = await _ids(s, url, "files", headers)
            assert b_file in files and not files & {a_file, a_error_file}
            assert a_batch not in await _ids(s, url, "batches", headers)
            for method, path in (("GET", f"/v1/files/{a_file}"),
                                 ("GET", f"/v1/files/{a_file}/content"),
                                 ("GET", f"/v1/files/{a_error_file}/content"),
                                 ("DELETE", f"/v1/files/{a_file}"),
                                 ("GET", f"/v1/batches/{a_batch}"),
                                 ("POST", f"/v1/batches/{a_batch}/cancel")):
                async with s.request(method, url + path, headers=headers) as resp:
                    assert resp.status == 404, (method, path, await resp.text())
            async with s.post(f"{url}/v1/batches", headers=headers, json={
                    "input_file_id": a_file, "endpoint": "/v1/completions",
                    "completion_window": "24h"}) as resp:
                assert resp.status == 404, await resp.text()

        # A still has all of it, and does not see B's file.
        files = await _ids(s, url, "files", a)
        assert {a_file, a_error_file} <= files and b_file not in files
        assert a_batch in await _ids(s, url, "batches", a)
        async with s.get(f"{url}/v1/files/{a_file}/content", headers=a) as resp:
            assert resp.status == 200 and await resp.read() == LINE
        async with s.get(f"{url}/v1/files/{b_file}", headers=a) as resp:
            assert resp.status == 404
        async with s.delete(f"{url}/v1/files/{a_file}", headers=a) as resp:
            assert resp.status == 200 and (await resp.json())["deleted"] is True


async def test_without_tenants_a_client_sent_owner_is_dropped(replica, gateway) -> None:
    """An open gateway names no owner, and strips one a client sends: what it stores stays
    visible to every client, as before tenants isolated anything."""
    replica_url = await replica()
    _, url = await gateway(_config([replica_url], tenants=False))
    async with aiohttp.ClientSession() as s:
        file_id = (await _upload(s, url, {"X-Argosy-Owner": "someone"}))["id"]
        assert file_id in await _ids(s, url, "files", {})
        assert file_id in await _ids(s, replica_url, "files", {"X-Argosy-Owner": "other"})
