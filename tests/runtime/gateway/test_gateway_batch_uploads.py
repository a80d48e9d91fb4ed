"""`POST /v1/files` through the gateway against a replica running the real Batch API routes
(no model): the gateway takes any upload the replica takes, whatever its own request body
limit, and an upload over the limit is a clear 413 from whichever of the two refuses it.

The limits are shrunk (the gateway's body limit, the file limit of both) so the tests send
kilobytes, not 200 MiB."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
from argosy_runtime.gateway.config import GatewayConfig, HealthConfig, ModelRouteConfig
from argosy_runtime.gateway.proxy import app as gateway_app
from argosy_runtime.gateway.proxy import batch_routes
from argosy_runtime.server.batch.file_store import FileStore
from batch_replica import BatchReplica, start_batch_replica
from http_helpers import serve_app

BODY_LIMIT = 8 * 1024  # the gateway's request body limit in these tests
FILE_LIMIT = 64 * 1024  # the file limit of the gateway and the replica


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[tuple[str, FileStore]]]]:
    """`await replica(max_bytes[, root])` -> (URL, its FileStore): the replica's Batch API
    routes, on a folder of its own unless `root` names one to share."""
    started: list[BatchReplica] = []

    async def make(max_bytes: int, root: Path | None = None) -> tuple[str, FileStore]:
        started.append(await start_batch_replica(root or tmp_path / f"replica{len(started)}",
                                                 max_bytes))
        return started[-1].url, started[-1].files

    yield make
    for r in started:
        await r.stop()


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_app, "MAX_BODY_BYTES", BODY_LIMIT)
    monkeypatch.setattr(batch_routes, "MAX_FILE_BYTES", FILE_LIMIT)


def _config(url: str) -> GatewayConfig:
    return GatewayConfig(models=(ModelRouteConfig(name="tiny", backends=(url,)),),
                         health=HealthConfig(interval_s=60))


def _jsonl(size: int) -> bytes:
    """A batch file of about `size` bytes (at least one line)."""
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "x" * 200}}).encode() + b"\n"
    data = line * max(1, size // len(line))
    return data + b"x" * (size - len(data)) if size > len(data) else data


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_an_upload_over_the_gateways_body_limit_reaches_the_replica(
        small_limits, replica, gateway) -> None:
    replica_url, files = await replica(FILE_LIMIT)
    _, url = await gateway(_config(replica_url))
    data = _jsonl(FILE_LIMIT)
    assert BODY_LIMIT < len(data) == FILE_LIMIT
    async with _client(url) as client:
        uploaded = await client.files.create(file=("big.jsonl", io.BytesIO(data)),
                                             purpose="batch")
        assert (uploaded.bytes, uploaded.filename) == (len(data), "big.jsonl")
        assert (await client.files.content(uploaded.id)).content == data
    assert [f["id"] for f in files.list()] == [uploaded.id]


async def test_an_upload_over_the_file_limit_is_a_413_from_the_gateway(
        small_limits, replica, gateway) -> None:
    replica_url, files = await replica(FILE_LIMIT)
    _, url = await gateway(_config(replica_url))
    # Far over the limit: the client is still sending when the gateway has seen enough, and
    # must get the answer, not a reset connection.
    data = _jsonl(FILE_LIMIT * 64)
    async with _client(url) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert caught.value.status_code == 413
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"], error["type"]) == (
        "file", "file_too_large", "invalid_request_error")
    assert f"upload limit of {FILE_LIMIT} bytes" in error["message"]
    assert files.list() == []  # refused before any replica saw it


async def test_a_replica_with_a_smaller_limit_refuses_with_the_same_413(
        small_limits, replica, gateway) -> None:
    replica_url, files = await replica(FILE_LIMIT // 2)
    _, url = await gateway(_config(replica_url))
    async with _client(url) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("big.jsonl", io.BytesIO(_jsonl(FILE_LIMIT))),
                                      purpose="batch")
    assert caught.value.status_code == 413
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "file_too_large"
    assert f"upload limit of {FILE_LIMIT // 2} bytes" in error["message"]
    # Sent to the replica directly, far over its limit: the same answer, no reset connection.
    async with _client(replica_url) as client:
        with pytest.raises(openai.APIStatusError) as direct:
            await client.files.create(file=("big.jsonl", io.BytesIO(_jsonl(FILE_LIMIT * 64))),
                                      purpose="batch")
    assert direct.value.status_code == 413 and direct.value.body == error
    assert files.list() == []


async def test_an_upload_that_is_not_multipart_is_a_400(small_limits, replica, gateway) -> None:
    replica_url, _ = await replica(FILE_LIMIT)
    _, url = await gateway(_config(replica_url))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/files", json={"purpose": "batch"}) as resp:
            assert resp.status == 400
            assert "multipart/form-data" in (await resp.json())["error"]["message"]
        with aiohttp.MultipartWriter("form-data") as form:
            form.append("batch").set_content_disposition("form-data", name="purpose")
        async with session.post(f"{url}/v1/files", data=form) as resp:
            assert resp.status == 400
            assert "'file'" in (await resp.json())["error"]["message"]


async def test_replicas_sharing_a_folder_list_each_file_once(replica, gateway,
                                                             tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    first, files = await replica(FILE_LIMIT, shared)
    second, _ = await replica(FILE_LIMIT, shared)
    _, url = await gateway(GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=(first, second)),),
        health=HealthConfig(interval_s=60)))
    data = _jsonl(1000)
    async with _client(url) as client:
        uploaded = await client.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
        listed = await client.files.list()
        assert [f.id for f in listed.data] == [uploaded.id]  # both replicas list it
        assert (await client.files.content(uploaded.id)).content == data
    assert [f["id"] for f in files.list()] == [uploaded.id]


async def test_an_uploads_expires_after_reaches_the_replica(replica, gateway) -> None:
    # The gateway passed on `purpose` alone: the expiry was silently dropped (and a bad one
    # accepted). Every form field goes on now, for the replica to check.
    replica_url, _ = await replica(FILE_LIMIT)
    _, url = await gateway(_config(replica_url))
    async with _client(url) as client:
        uploaded = await client.files.create(
            file=("in.jsonl", io.BytesIO(_jsonl(500))), purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600})
        assert uploaded.expires_at == uploaded.created_at + 3600
        with pytest.raises(openai.BadRequestError, match="expires_after"):
            await client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(500))),
                                      purpose="batch",
                                      expires_after={"anchor": "created_at", "seconds": 60})


async def test_a_replica_hanging_on_its_list_leaves_it_out_in_the_health_timeout(
        replica, gateway) -> None:
    """A replica that is healthy but does not answer its list (its --batch-dir on a stalled
    network file system, say) is left out after `health.timeout_s`, as other id lookups are:
    the list waited for it the session's 5 minutes."""
    import asyncio
    import time

    from aiohttp import web

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    released = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await asyncio.wait_for(released.wait(), 60)
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/ready", ok)
    app.router.add_get("/v1/models", ok)
    async def no_metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    app.router.add_get("/metrics", no_metrics)
    app.router.add_get("/v1/files", hang)
    runner, stuck = await serve_app(app)
    good, files = await replica(FILE_LIMIT)
    uploaded = files.create(io.BytesIO(_jsonl(500)), "a.jsonl", "batch")
    try:
        _, url = await gateway(GatewayConfig(
            models=(ModelRouteConfig(name="tiny", backends=(good, stuck)),),
            health=HealthConfig(interval_s=60, timeout_s=0.5)))
        async with _client(url) as client:
            start = time.monotonic()
            listed = await client.files.list()
            assert time.monotonic() - start < 10
        assert [f.id for f in listed.data] == [uploaded["id"]]
    finally:
        released.set()
        await runner.cleanup()
