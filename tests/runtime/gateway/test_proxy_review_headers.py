"""Review of the gateway's header handling between clients and replicas (proxy/headers.py):
the end-to-end headers a replica's answer relies on reach the client, and the gateway does not
ask replicas for encodings on a client's behalf."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from fake_replica import Served
from gateway_helpers import servers_of, tiny_config

COMPLETION = {"model": "tiny", "prompt": "x", "max_tokens": 4}


class AppReplica(Served):
    """A replica played by one aiohttp handler for POST /v1/completions (no health routes:
    the tests' configs probe nothing)."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler
        self.url = ""
        self._runner = None
        self.accept_encodings: list[str | None] = []

    async def start(self) -> str:
        app = web.Application()

        async def handle(request: web.Request) -> web.StreamResponse:
            self.accept_encodings.append(request.headers.get("Accept-Encoding"))
            await request.read()
            return await self.handler(request)

        app.router.add_post("/v1/completions", handle)
        return await self._serve(app)


@pytest.fixture
async def app_replica() -> AsyncIterator[Callable[..., Awaitable[AppReplica]]]:
    async with servers_of(AppReplica) as make:
        yield make


async def test_a_stream_keeps_the_replicas_x_accel_buffering_no(app_replica, gateway) -> None:
    # The runtime marks its SSE answers `X-Accel-Buffering: no` (server/streaming.py) so that
    # an nginx in front does not buffer the stream; the gateway must not drop it.
    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    replica = await app_replica(sse)
    _, url = await gateway(tiny_config(replica.url))
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                   json={**COMPLETION, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers.get("X-Accel-Buffering") == "no"
        assert resp.headers.get("Cache-Control") == "no-cache"
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_a_replicas_401_is_passed_through_with_its_challenge(app_replica, gateway) -> None:
    # Without tenants the client's own key goes to the replica; its 401 (as the runtime answers
    # it: request_log.py) reaches the client unchanged, `WWW-Authenticate` included.
    async def unauthorized(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "invalid or missing API key", "type": "authentication_error",
                       "param": None, "code": "invalid_api_key"}},
            status=401, headers={"WWW-Authenticate": "Bearer"})

    replica = await app_replica(unauthorized)
    _, url = await gateway(tiny_config(replica.url))
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=COMPLETION,
                                                   headers={"Authorization": "Bearer no"}) as resp:
        assert resp.status == 401
        assert resp.headers.get("WWW-Authenticate") == "Bearer"
        assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_replicas_are_not_asked_for_an_encoding_the_client_did_not_ask_for(
        app_replica, gateway) -> None:
    # A replica behind a compressing sidecar gzips when its request accepts gzip. The gateway
    # relays bytes as they come (and parses them: usage, logprobs, ids), so it must not claim
    # gzip on a client's behalf: a client that asked for no encoding would get gzip bytes.
    answer = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]}

    async def compressing(request: web.Request) -> web.Response:
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=gzip.compress(json.dumps(answer).encode()),
                                headers={"Content-Type": "application/json",
                                         "Content-Encoding": "gzip"})
        return web.json_response(answer)

    replica = await app_replica(compressing)
    _, url = await gateway(tiny_config(replica.url))
    async with aiohttp.ClientSession(auto_decompress=False) as s, s.post(
            f"{url}/v1/completions", json=COMPLETION,
            skip_auto_headers=["Accept-Encoding"]) as resp:
        assert resp.status == 200
        assert "Content-Encoding" not in resp.headers
        assert json.loads(await resp.read()) == answer
    assert replica.accept_encodings == ["identity"]
