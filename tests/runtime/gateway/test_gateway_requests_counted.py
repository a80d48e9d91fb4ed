"""argosy:gateway_requests_total counts every request the gateway relays, with the code of
what reached the client (proxy/relay.py): the calls on stored objects (a stored response, its
events; Batch API files and batches) as generations are, and a client that leaves during
the cascade's confidence check as a 499. Also: the fake replica registers no deprecated
(bare function) handler."""

from __future__ import annotations

import asyncio
import io
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from argosy_runtime.gateway.config import (
    CascadeConfig,
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
)
from batch_replica import start_batch_replica
from fake_replica import FakeReplica, Served
from gateway_helpers import all_counted, counts_a_499_not_a_200, eventually
from gateway_helpers import tiny_config as config


class StoredReplica(Served):
    """A replica holding stored responses and files (any id): a stored response's events
    (`GET /v1/responses/{id}?stream=true`) and a file's content come in `chunks` pieces,
    `delay` seconds apart."""

    def __init__(self, chunks: int = 4, delay: float = 0.01) -> None:
        self.chunks, self.delay = chunks, delay
        self.disconnects = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/responses/{id}", self._response)
        app.router.add_get("/v1/files/{id}", self._file)
        app.router.add_get("/v1/files/{id}/content", self._content)
        await self._serve(app)

    async def _ready(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    async def _file(self, request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["id"], "object": "file"})

    async def _response(self, request: web.Request) -> web.StreamResponse:
        if "stream" not in request.query:
            return web.json_response({"id": request.match_info["id"], "object": "response"})
        return await self._pieces(request, "text/event-stream",
                                  lambda i: b'data: {"type": "event", "n": %d}\n\n' % i)

    async def _content(self, request: web.Request) -> web.StreamResponse:
        return await self._pieces(request, "application/octet-stream",
                                  lambda i: b'{"custom_id": "c%d"}\n' % i)

    async def _pieces(self, request: web.Request, content_type: str, piece) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                await resp.write(piece(i))
                await asyncio.sleep(self.delay)
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        return resp


@pytest.fixture
async def stored_replica() -> AsyncIterator[StoredReplica]:
    replica = StoredReplica()
    await replica.start()
    yield replica
    await replica.stop()


@pytest.fixture
async def slow_stored(stored_replica, gateway) -> tuple[StoredReplica, str]:
    """The stored replica sending 50 pieces 0.05 s apart, and the URL of a gateway to it."""
    r = stored_replica
    r.chunks, r.delay = 50, 0.05
    _, url = await gateway(config(r.url))
    return r, url


async def first_piece(s: aiohttp.ClientSession, url: str, path: str,
                      end: bytes) -> aiohttp.ClientResponse:
    """GET `path` through the gateway: a 200, read up to the end of its first piece."""
    resp = await s.get(f"{url}{path}")
    assert resp.status == 200
    await resp.content.readuntil(end)
    return resp


# -- stored responses ---------------------------------------------------------------------------


async def test_calls_on_a_stored_response_count_under_its_replicas_model(stored_replica,
                                                                        gateway) -> None:
    r = stored_replica
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/responses/resp_a") as resp:
            assert resp.status == 200 and (await resp.json())["id"] == "resp_a"
        async with s.get(f"{url}/v1/responses/resp_a?stream=true") as resp:
            assert resp.status == 200
            assert (await resp.read()).count(b"data: ") == r.chunks
        # The owner lookups (GET /v1/responses/{id} on every replica) are the gateway's own.
        assert await all_counted(s, url) == {("tiny", r.url, "200"): 2}


async def test_a_stored_responses_stream_whose_client_leaves_counts_as_a_499(
        slow_stored) -> None:
    r, url = slow_stored
    async with aiohttp.ClientSession() as s:
        resp = await first_piece(s, url, "/v1/responses/resp_a?stream=true", b"\n\n")
        resp.close()  # the client goes away mid-stream
        await counts_a_499_not_a_200(s, url, r.url)
    await eventually(lambda: asyncio.sleep(0, r.disconnects == 1))


async def test_a_stored_responses_stream_whose_replica_dies_counts_as_a_502(
        slow_stored) -> None:
    r, url = slow_stored
    async with aiohttp.ClientSession() as s:
        async with await first_piece(s, url, "/v1/responses/resp_a?stream=true",
                                     b"\n\n") as resp:
            await r.kill()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert await all_counted(s, url) == {("tiny", r.url, "502"): 1}


async def test_a_call_on_a_stored_response_whose_replica_is_gone_counts_as_a_502(
        stored_replica, gateway) -> None:
    r = stored_replica
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/responses/resp_a") as resp:
            assert resp.status == 200  # remembered as living on r
        await r.stop()  # still in rotation: no probe has run since
        async with s.get(f"{url}/v1/responses/resp_a") as resp:
            assert resp.status == 502
        assert await all_counted(s, url) == {("tiny", r.url, "200"): 1,
                                             ("tiny", r.url, "502"): 1}


# -- Batch API ----------------------------------------------------------------------------------


async def test_batch_api_calls_count_under_the_model_of_their_replica(tmp_path: Path,
                                                                      gateway) -> None:
    replica = await start_batch_replica(tmp_path / "replica")
    try:
        _, url = await gateway(config(replica.url))
        line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "tiny", "prompt": "x"}}).encode() + b"\n"
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(line)),
                                                 purpose="batch")
            assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
            assert (await client.files.content(uploaded.id)).content == line
            batch = await client.batches.create(input_file_id=uploaded.id,
                                                endpoint="/v1/completions",
                                                completion_window="24h")
            await client.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):  # the gateway's own 404: no replica
                await client.files.retrieve("file-nowhere")
        async with aiohttp.ClientSession() as s:
            assert await all_counted(s, url) == {("tiny", replica.url, "200"): 5}
    finally:
        await replica.stop()


async def test_a_files_content_cut_by_its_replica_counts_as_a_502_and_ends_badly(
        slow_stored) -> None:
    """The content is relayed as it arrives: a replica that breaks mid-way cuts the client's
    connection (it never looks whole), and it counts as the 502 it is."""
    r, url = slow_stored
    async with aiohttp.ClientSession() as s:
        async with await first_piece(s, url, "/v1/files/file-a/content", b"\n") as resp:
            await r.kill()
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(resp.read(), 5)  # not a stream left hanging
        assert await all_counted(s, url) == {("tiny", r.url, "502"): 1}


async def test_a_files_content_whose_client_leaves_counts_as_a_499(slow_stored) -> None:
    r, url = slow_stored
    async with aiohttp.ClientSession() as s:
        resp = await first_piece(s, url, "/v1/files/file-a/content", b"\n")
        resp.close()

        async def counted() -> bool:
            return await all_counted(s, url) == {("tiny", r.url, "499"): 1}

        await eventually(counted)
        assert await client_disconnects(s, url, "tiny") == 1


async def test_a_files_content_slower_than_the_sessions_timeout_is_not_cut(
        stored_replica, gateway, monkeypatch) -> None:
    """A large output file to a slow client can take longer than the upstream session's
    default total timeout (aiohttp's 5 min, shrunk here): relayed with no total timeout, as
    a stored response's events are, it must not be cut (and counted as a 502) part-way."""
    monkeypatch.setattr(aiohttp.client, "DEFAULT_TIMEOUT",
                        aiohttp.ClientTimeout(total=0.3, sock_connect=30))
    r = stored_replica
    r.chunks, r.delay = 8, 0.1  # 0.8 s in all
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.get(f"{url}/v1/files/file-a/content") as resp:
            assert resp.status == 200
            assert (await resp.read()).count(b"custom_id") == r.chunks
        assert await all_counted(s, url) == {("tiny", r.url, "200"): 1}


# -- the cascade's confidence check ---------------------------------------------------------------


class StallingReplica(FakeReplica):
    """Sends the first bytes of a non-streamed answer, then nothing more."""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"id": "x", ')
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        return resp


async def test_a_client_leaving_during_the_confidence_check_counts_as_a_499(fake_replicas,
                                                                            gateway) -> None:
    small = StallingReplica(model="tiny")
    await small.start()
    try:
        (large,) = await fake_replicas(1, model="big")
        cascade = CascadeConfig(name="auto", small="tiny", large="big", min_mean_logprob=-1.0)
        gw, url = await gateway(GatewayConfig(
            models=(ModelRouteConfig(name="tiny", backends=(small.url,)),
                    ModelRouteConfig(name="big", backends=(large.url,))),
            cascades=(cascade,), health=HealthConfig(interval_s=60)))
        chat = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:
            with pytest.raises(TimeoutError):  # the small model's answer has begun by then
                await s.post(f"{url}/v1/chat/completions", json=chat,
                             timeout=aiohttp.ClientTimeout(total=0.5))

            async def counted() -> bool:
                return await all_counted(s, url) == {("tiny", small.url, "499"): 1}

            await eventually(counted)
        await eventually(lambda: asyncio.sleep(0, small.disconnects == 1))
        assert not large.requests
        assert gw.pools["tiny"].replicas[0].in_flight == 0
    finally:
        await small.stop()


async def test_a_request_the_large_model_takes_for_an_unavailable_small_counts_once(
        fake_replicas, gateway) -> None:
    """The small model that cannot take a request (its replicas failing) is no answer: the
    large model's answer is counted, not also the small model's refusal."""
    (small,) = await fake_replicas(1, model="tiny")
    (large,) = await fake_replicas(1, model="big")
    plain = CascadeConfig(name="plain", small="tiny", large="big")
    checked = CascadeConfig(name="auto", small="tiny", large="big", min_mean_logprob=-1.0)
    _, url = await gateway(GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=(small.url,)),
                ModelRouteConfig(name="big", backends=(large.url,))),
        cascades=(plain, checked), health=HealthConfig(interval_s=60), max_attempts=1))
    async with aiohttp.ClientSession() as s:
        for route, extra in (("plain", {}), ("plain", {"stream": True}), ("auto", {})):
            small.fail_next, small.fail_status = 1, 503
            async with s.post(f"{url}/v1/completions",
                              json={"model": route, "prompt": "hello", **extra}) as resp:
                await resp.read()
                assert (resp.status, resp.headers["x-argosy-cascade"]) == (200, "large")
        # Asked for by name, the small model's error is the answer: counted as such.
        small.fail_next = 1
        async with s.post(f"{url}/v1/completions",
                          json={"model": "plain:small", "prompt": "hello"}) as resp:
            assert resp.status == 503
        assert await all_counted(s, url) == {("big", large.url, "200"): 3,
                                             ("tiny", "", "503"): 1}


# -- the fake replica ------------------------------------------------------------------------------


async def test_the_fake_replica_registers_no_deprecated_handler() -> None:
    """A bare function (a lambda) as a handler makes aiohttp warn on every replica started:
    hundreds of warnings over the suite, hiding the ones that matter."""
    replica = FakeReplica()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await replica.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{replica.url}/health") as resp:
                assert resp.status == 200 and await resp.json() == {"status": "ok"}
    finally:
        await replica.stop()
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)] == []


# -- refusals and clients leaving before the first byte -------------------------------------------


async def client_disconnects(s: aiohttp.ClientSession, url: str, model: str) -> float:
    """argosy:gateway_client_disconnects_total for `model` (0 when absent)."""
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = f'argosy:gateway_client_disconnects_total{{model="{model}"}} '
    return next((float(line[len(wanted):]) for line in text.splitlines()
                 if line.startswith(wanted)), 0.0)


async def test_a_client_leaving_before_the_first_byte_counts_as_a_disconnect(
        fake_replicas, gateway) -> None:
    """Left before the replica's first byte (Gateway._send) or mid-answer (relay): both are
    a 499 in argosy:gateway_requests_total and a client disconnect."""
    (r,) = await fake_replicas(1, first_byte_delay=30)
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            await s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"},
                         timeout=aiohttp.ClientTimeout(total=0.5))

        async def counted() -> bool:
            return await all_counted(s, url) == {("tiny", "", "499"): 1}

        await eventually(counted)
        assert await client_disconnects(s, url, "tiny") == 1


async def test_an_upload_with_no_replica_available_counts_as_a_generations_503(
        gateway) -> None:
    gone = "http://127.0.0.1:9"  # nothing listens there: the start-up probe fails too
    gw, url = await gateway(config(gone))
    gw.pools["tiny"].replicas[0].healthy = False  # out of rotation
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "x"}}).encode() + b"\n"
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                  max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.files.create(file=("in.jsonl", io.BytesIO(line)), purpose="batch")
        assert refused.value.status_code == 503
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="tiny", prompt="x")
    async with aiohttp.ClientSession() as s:
        assert await all_counted(s, url) == {("tiny", "", "503"): 2}
