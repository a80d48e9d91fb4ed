"""Calls on an id the gateway does not remember (made through another gateway pod, or before
a restart) are looked up on every replica in rotation (proxy/id_owners.py), against replicas
running the real Batch API routes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import aiohttp
import openai
import pytest
from argosy_runtime.gateway.config import GatewayConfig, HealthConfig, ModelRouteConfig
from batch_replica import start_batch_replica

LINE = b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}\n'


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_an_id_whose_replica_cannot_answer_is_a_503_not_a_404(gateway,
                                                                   tmp_path: Path) -> None:
    holder = await start_batch_replica(tmp_path / "holder")
    other = await start_batch_replica(tmp_path / "other")
    try:
        # Uploaded through another gateway: this one does not remember where it lives.
        async with _client(holder.url) as direct:
            uploaded = await direct.files.create(file=("a.jsonl", io.BytesIO(LINE)),
                                                 purpose="batch")
        _, url = await gateway(GatewayConfig(
            models=(ModelRouteConfig(name="tiny", backends=(holder.url, other.url)),),
            health=HealthConfig(interval_s=60)))  # no probes: both stay in rotation
        async with _client(url) as client:
            assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
            with pytest.raises(openai.NotFoundError):  # every replica says it has no such id
                await client.files.retrieve("file-unknown")
        await holder.stop()  # the holder stops answering (it is still in rotation)
        async with _client(url) as client:
            # A new gateway pod, say: it must ask, and the holder cannot say. A 404 would
            # tell the client its file is gone for good; a 503 is retried.
            with pytest.raises(openai.InternalServerError) as caught:
                await client.batches.retrieve("batch-made-elsewhere")
            assert caught.value.status_code == 503
            assert caught.value.response.headers["Retry-After"] == "1"
            error = caught.value.body
            # how many could not say; their addresses stay in the gateway's log
            assert isinstance(error, dict) and "1 of 2 did not answer" in error["message"]
            assert holder.url not in error["message"]
            assert error["type"] == "service_unavailable_error"
    finally:
        await other.stop()
        if not holder.task.done():
            await holder.stop()


async def test_an_id_that_is_not_text_is_a_404_not_a_500(gateway, tmp_path: Path) -> None:
    replica = await start_batch_replica(tmp_path / "replica")
    try:
        _, url = await gateway(GatewayConfig(
            models=(ModelRouteConfig(name="tiny", backends=(replica.url,)),),
            health=HealthConfig(interval_s=60)))
        # A lone surrogate is valid JSON; no replica ever made such an id.
        lone = "\ud800"
        async with aiohttp.ClientSession() as s:
            for path, body, code in (
                    ("/v1/responses", {"model": "tiny", "input": "hi",
                                       "previous_response_id": lone},
                     "previous_response_not_found"),
                    ("/v1/batches", {"input_file_id": lone, "endpoint": "/v1/completions",
                                     "completion_window": "24h"}, "file_not_found")):
                async with s.post(url + path, data=json.dumps(body),
                                  headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 404, await resp.text()
                    error = (await resp.json())["error"]
                    assert (error["type"], error["code"]) == ("not_found_error", code)
    finally:
        await replica.stop()
