"""The gateway against hostile or careless clients and misbehaving replicas.

A client's mistake is a 4xx in the OpenAI error shape and disturbs nobody else; a replica's
failure is a clear error in that shape; nothing the routing counts (in-flight requests) is
left behind. Replicas that misbehave below HTTP (a cut body, an answer that is not HTTP) are
played by `RawReplica`, a socket server answering canned bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from argosy_runtime.gateway.config import (
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    TenantConfig,
)
from argosy_runtime.gateway.proxy import app as gateway_app
from argosy_runtime.gateway.proxy.upstream import MAX_RETRY_AFTER_S, parse_retry_after
from gateway_helpers import servers_of
from http_helpers import serve_app

COMPLETION = {"model": "tiny", "prompt": "x", "max_tokens": 4}
ERROR_FIELDS = {"message", "type", "param", "code"}


def config(*urls: str, policy: str = "prefix-affinity", **kw) -> GatewayConfig:
    kw.setdefault("health", HealthConfig(interval_s=60))  # no probes: only the test's requests
    return GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=urls, policy=policy),), **kw)


async def error_of(resp: aiohttp.ClientResponse) -> dict:
    """The OpenAI-shaped error of an answer (fails on any other body)."""
    assert resp.content_type == "application/json", await resp.text()
    error = (await resp.json())["error"]
    assert set(error) == ERROR_FIELDS
    return error


def in_flight(gw) -> list[int]:
    return [r.in_flight for pool in gw.pools.values() for r in pool.replicas]


class RawReplica:
    """A socket server that answers every request with `answer` (bytes), then closes the
    connection, or with `answer(request line, writer)` when it is a coroutine function."""

    def __init__(self, answer: bytes | Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]):
        self.answer = answer
        self.requests: list[bytes] = []  # request lines ("POST /v1/completions HTTP/1.1")
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.requests.append(head.split(b"\r\n", 1)[0])
            if callable(self.answer):
                await self.answer(self.requests[-1], writer)
            else:
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw_replica() -> AsyncIterator[Callable[..., Awaitable[RawReplica]]]:
    async with servers_of(RawReplica) as make:
        yield make


# -- client input ------------------------------------------------------------------------------


async def test_a_lone_surrogate_in_the_prompt_is_the_replicas_400_not_a_500(
        fake_replicas, gateway) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"); Python decodes it into a str no UTF-8
    codec takes. Prefix affinity hashes the prompt: that must not raise (the replica, which
    refuses such a body with its 400, gets to say so), for completions, chat and embeddings."""
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url))
    text = "\\ud800 a prompt long enough to be hashed"  # escaped in the raw JSON below
    bodies = {
        "/v1/completions": f'{{"model": "tiny", "prompt": "{text}"}}',
        "/v1/chat/completions":
            f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{text}"}}]}}',
        "/v1/embeddings": f'{{"model": "tiny", "input": "{text}"}}',
    }
    async with aiohttp.ClientSession() as s:
        for path, raw in bodies.items():
            async with s.post(f"{url}{path}", data=raw.encode(),
                              headers={"Content-Type": "application/json"}) as resp:
                # The fake replica takes it (the real one answers 400 malformed JSON): it
                # reached the replica, which is what the gateway decides.
                assert resp.status == 200, (path, await resp.text())
    assert len(r.requests) == 3 and in_flight(gw) == [0]


async def test_json_nested_too_deep_is_a_400_not_a_500(fake_replicas, gateway) -> None:
    """Python's json recurses per level: a small body of 100000 `[` raises RecursionError,
    which must be the same 400 as any malformed JSON (also inside an object, and for the
    Responses API and a batch's creation)."""
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url))
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = [
        ("/v1/completions", deep),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + deep + b"}"),
        ("/v1/responses", deep),
        ("/v1/batches", b'{"input_file_id": ' + deep + b"}"),
    ]
    async with aiohttp.ClientSession() as s:
        for path, raw in cases:
            async with s.post(f"{url}{path}", data=raw,
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400, path
                error = await error_of(resp)
                assert error["type"] == "invalid_request_error"
                assert "malformed JSON body" in error["message"]
        # Nobody else is disturbed: the next request is answered as usual.
        async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 200
    assert len(r.requests) == 1 and in_flight(gw) == [0]


async def test_a_number_of_too_many_digits_is_a_400_not_a_500(fake_replicas, gateway) -> None:
    """Python refuses to read an integer of more than 4300 digits (a plain ValueError, not a
    JSONDecodeError): a 20 kB `max_tokens` is the client's malformed body, a 400 that does not
    tell the client how to lift a Python limit, for every route that reads the body."""
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url))
    huge = b"1" * 5000
    cases = [
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": ' + huge + b"}"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [], "seed": ' + huge + b"}"),
        ("/v1/responses", b'{"model": "tiny", "input": "x", "max_output_tokens": ' + huge + b"}"),
        ("/v1/batches", b'{"input_file_id": "f", "n": ' + huge + b"}"),
    ]
    async with aiohttp.ClientSession() as s:
        for path, raw in cases:
            async with s.post(f"{url}{path}", data=raw,
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400, (path, await resp.text())
                error = await error_of(resp)
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith("malformed JSON body: a number has more digits")
    assert r.requests == [] and in_flight(gw) == [0]


async def test_a_wrong_method_is_a_405_naming_the_allowed_ones(fake_replicas, gateway) -> None:
    """GET /v1/chat/completions (a client that forgot its body) was the catch-all's 404 "not
    found", as if the gateway had no such route; the runtime server answers a 405 with
    `Allow`, and so does the gateway now. Unknown paths stay 404."""
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        for method, path, allow in [("GET", "/v1/chat/completions", "POST"),
                                    ("PUT", "/v1/models", "GET, HEAD"),
                                    ("POST", "/health", "GET, HEAD")]:
            async with s.request(method, f"{url}{path}") as resp:
                assert (resp.status, resp.headers.get("Allow")) == (405, allow), path
                error = await error_of(resp)
                assert error["type"] == "invalid_request_error"
                assert error["message"] == (f"method not allowed: {method} {path} "
                                            f"(allowed: {allow})")
        async with s.get(f"{url}/v1/nope") as resp:
            assert resp.status == 404 and "Allow" not in resp.headers
            assert (await error_of(resp))["type"] == "not_found_error"
    assert r.requests == []


async def test_a_batch_upload_whose_first_line_nests_too_deep_is_not_a_500(
        fake_replicas, gateway) -> None:
    """The upload's first request names the model it is routed by; a line that cannot be
    parsed names none (the replica then judges the file), whatever makes it unparseable."""
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(r.url))
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"[" * 100_000 + b"\n", filename="in.jsonl",
                   content_type="application/jsonl")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/files", data=form) as resp:
            # The fake replica has no Batch API: its 404 proves the upload got through.
            assert resp.status == 404


async def test_a_body_over_the_limit_is_an_openai_413(fake_replicas, gateway,
                                                      monkeypatch) -> None:
    """aiohttp refuses a body over `client_max_size` with a plain-text 413; clients get the
    runtime server's answer instead (`request_too_large`)."""
    monkeypatch.setattr(gateway_app, "MAX_BODY_BYTES", 4096)
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        big = {**COMPLETION, "prompt": "x" * 8192}
        for path in ("/v1/completions", "/v1/responses"):
            async with s.post(f"{url}{path}", json=big) as resp:
                assert resp.status == 413
                error = await error_of(resp)
                assert (error["type"], error["code"]) == ("invalid_request_error",
                                                          "request_too_large")
                assert "4096 bytes" in error["message"]
        async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 200
    assert r.requests == [COMPLETION] and in_flight(gw) == [0]


async def test_an_authorization_header_that_is_not_utf8_is_a_401_not_a_500(
        fake_replicas, gateway) -> None:
    """Header bytes that are not UTF-8 reach the gateway as surrogate escapes; hashing the
    presented key must not raise on them: an unknown key is a 401."""
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url, tenants=(
        TenantConfig(name="a", api_keys=("sk-a",), max_concurrent=4),)))
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(COMPLETION).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer sk-\xff\xfe\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), answer[:200]
    assert json.loads(payload)["error"]["code"] == "invalid_api_key"
    assert r.requests == [] and gw.tenants.limiters["a"].in_flight == 0


# -- misbehaving replicas ----------------------------------------------------------------------


async def test_a_replica_answering_garbage_is_retried_then_a_502(raw_replica, fake_replicas,
                                                                gateway) -> None:
    """An answer that is not HTTP (a wrong port, a crashed proxy) is a failed try like a 5xx:
    the request goes to another replica, and when none is left it is a 502 naming the
    replica, never the gateway's own 500."""
    bad = await raw_replica(b"NOT HTTP AT ALL\r\n\r\n")
    (good,) = await fake_replicas(1)
    # The start-up probe fails on it too: keep it in rotation for the last step.
    gw, url = await gateway(config(bad.url, good.url, policy="round-robin",
                                   health=HealthConfig(interval_s=60, unhealthy_after=10)))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round-robin: at least one of the two starts at the bad replica
            async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200 and resp.headers["x-argosy-backend"] == good.url
        assert bad.requests.count(b"POST /v1/completions HTTP/1.1") >= 1
        await good.stop()
        gw.pools["tiny"].get(good.url).healthy = False  # gone: only the bad one is left
        async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 502
            error = await error_of(resp)
            assert error["type"] == "bad_gateway_error" and bad.url in error["message"]
    assert in_flight(gw) == [0, 0]


@pytest.mark.parametrize("answer", [
    b"",  # the connection closed with no answer
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
], ids=["before_the_headers", "after_the_headers"])
async def test_a_replica_cutting_the_request_before_answering_is_a_502_naming_it(
        raw_replica, gateway, answer: bytes) -> None:
    """A replica that takes the request and closes the connection before the answer's first
    byte (a crash) stays in rotation, so on the last try the client's answer is a 502 naming
    it, not the 503 "no replica of 'tiny' is available" that sent operators looking for a
    scaling or discovery problem while /ready said the model was served."""
    bad = await raw_replica(answer)
    gw, url = await gateway(config(bad.url))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 502
            error = await error_of(resp)
            assert error["type"] == "bad_gateway_error" and bad.url in error["message"]
    assert in_flight(gw) == [0]


async def test_a_5xx_without_an_openai_body_becomes_one(raw_replica, gateway) -> None:
    """A replica's 5xx (or 429) body that is not an OpenAI error (a proxy's HTML page,
    uvicorn's bare "Internal Server Error") reaches the client as one, its status and
    Retry-After kept; a 5xx that is one passes unchanged (test_gateway_proxy.py)."""
    text_500 = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                b"Content-Length: 21\r\n\r\nInternal Server Error")
    html_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/html\r\n"
                b"Retry-After: 7\r\nContent-Length: 13\r\n\r\n<html></html>")
    for answer, status, err_type in ((text_500, 500, "internal_server_error"),
                                     (html_503, 503, "service_unavailable_error")):
        bad = await raw_replica(answer)
        gw, url = await gateway(config(bad.url))
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
                assert resp.status == status
                error = await error_of(resp)
                assert error["type"] == err_type
                assert bad.url in error["message"] and f"HTTP {status}" in error["message"]
                if status == 503:
                    assert resp.headers["Retry-After"] == "7"
        assert in_flight(gw) == [0]


async def test_a_stream_cut_by_its_replica_ends_with_an_error_event(raw_replica,
                                                                    gateway) -> None:
    """Bytes already reached the client, so nothing is retried: the stream ends with an SSE
    error event saying the replica failed (which the openai client raises as an APIError),
    and the connection is still cut without a clean end, so it never looks complete."""
    bad = await raw_replica(one_event_then_die)
    gw, url = await gateway(config(bad.url))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            received = await read_cut_stream(resp)
    assert_ends_with_error_event(received, bad.url)
    assert in_flight(gw) == [0]


@pytest.mark.parametrize("replica_then", ["dies", "hangs"])
async def test_a_background_responses_stream_cut_by_its_replica_ends_with_an_error_event(
        raw_replica, gateway, replica_then: str) -> None:
    """The same for a stored response's events (`GET /v1/responses/{id}?stream=true`),
    relayed to the replica holding it; one that hangs instead is cut after
    `stream_idle_timeout_s`."""

    async def answer(line: bytes, writer: asyncio.StreamWriter) -> None:
        if b"stream=true" in line:
            await one_event_then_die(line, writer)
            if replica_then == "hangs":
                await asyncio.sleep(30)
        else:  # the gateway asking who holds the id
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
            await writer.drain()

    bad = await raw_replica(answer)
    _, url = await gateway(config(bad.url, stream_idle_timeout_s=0.5))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/responses/resp_x?stream=true") as resp:
            received = await read_cut_stream(resp)
    assert_ends_with_error_event(received, bad.url)


async def test_a_stream_its_replica_stops_feeding_is_cut_after_stream_idle_timeout(
        fake_replicas, gateway) -> None:
    """A replica hung mid-stream (its first event sent, then nothing) is cut after
    `stream_idle_timeout_s` like one that broke: the client gets the error event and a cut
    connection instead of waiting forever, the replica sees its client leave (so it frees
    the request's KV), and the try counts as a failure toward `unhealthy_after`."""
    (hung,) = await fake_replicas(1, chunk_delay=30.0, num_chunks=2)
    gw, url = await gateway(config(hung.url, stream_idle_timeout_s=0.5,
                                   health=HealthConfig(interval_s=60, unhealthy_after=1)))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            received = await read_cut_stream(resp)
        async with s.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    events = [e for e in received.split(b"\n\n") if e]
    assert len(events) == 2 and hung.text_of(0).encode() in events[0]
    error = json.loads(events[1][6:])["error"]
    assert error["type"] == "bad_gateway_error" and hung.url in error["message"]
    for _ in range(50):
        if hung.disconnects:
            break
        await asyncio.sleep(0.05)
    assert hung.disconnects == 1 and hung.completed == 0
    assert not gw.pools["tiny"].get(hung.url).healthy
    assert in_flight(gw) == [0]
    assert f'argosy:gateway_requests_total{{backend="{hung.url}",code="502",model="tiny"}} 1.0' \
        in metrics


async def test_stream_idle_timeout_does_not_cut_a_stream_that_keeps_flowing(
        fake_replicas, gateway) -> None:
    """The deadline is between two reads, not on the whole answer: a stream slower in all
    (1.2 s) than the timeout (0.5 s), but never quiet that long, runs to its end."""
    (r,) = await fake_replicas(1, chunk_delay=0.3, num_chunks=4)
    gw, url = await gateway(config(r.url, stream_idle_timeout_s=0.5))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200
            raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n") and r.completed == 1
    assert gw.pools["tiny"].get(r.url).healthy


async def read_cut_stream(resp: aiohttp.ClientResponse) -> bytes:
    """The body of a 200 answer whose connection is cut before a clean end."""
    assert resp.status == 200
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for chunk in resp.content.iter_any():
            received += chunk
    return received


EVENT = b'data: {"id": "x", "choices": [{"index": 0, "text": "a"}]}\n\n'


async def one_event_then_die(_: bytes, writer: asyncio.StreamWriter) -> None:
    """A replica's SSE answer that breaks after its first event."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n"
                 + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n")
    await writer.drain()
    await asyncio.sleep(0.1)  # then the connection closes mid-stream


def assert_ends_with_error_event(received: bytes, replica_url: str) -> None:
    """The replica's event, then the gateway's error event, and no [DONE]."""
    event = EVENT
    events = [e for e in received.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == event and len(events) == 2
    assert events[1].startswith(b"data: ")
    error = json.loads(events[1][6:])["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "bad_gateway_error"
    assert replica_url in error["message"] and "incomplete" in error["message"]
    assert b"[DONE]" not in received


async def test_a_replica_listing_models_wrongly_breaks_nothing(fake_replicas, gateway) -> None:
    """/v1/models of a replica that answers JSON but not an object (a wrong service behind
    the URL, a broken proxy) counts as listing nothing: the merged list, and unknown-model
    answers (which read the replicas' lists for LoRA adapters), stay what they should be. So
    do its /v1/files and /v1/batches lists (not an object; items without an id)."""
    async def models(_: web.Request) -> web.Response:
        return web.json_response(["tiny"])

    async def batches(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"object": "batch"}, "b"]})

    odd = web.Application()
    odd.router.add_get("/v1/models", models)
    odd.router.add_get("/v1/files", models)
    odd.router.add_get("/v1/batches", batches)
    runner, odd_url = await serve_app(odd)
    try:
        (r,) = await fake_replicas(1)
        _, url = await gateway(config(r.url, odd_url))
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/models") as resp:
                assert resp.status == 200
                assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
            async with s.post(f"{url}/v1/completions", json={**COMPLETION, "model": "nope"}
                              ) as resp:
                assert resp.status == 404
                assert (await error_of(resp))["code"] == "model_not_found"
            for kind in ("files", "batches"):
                async with s.get(f"{url}/v1/{kind}") as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["data"] == []
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("policy", ["least-load", "prefix-affinity"])
async def test_a_replica_scraping_nan_load_does_not_break_routing(fake_replicas, gateway,
                                                                  policy: str) -> None:
    """A replica whose /metrics says `NaN` (or `+Inf`) for a load gauge (a ratio whose
    denominator was 0, another service's page): least-load (prefix affinity's fallback for
    short prompts) compared NaN scores, found no replica tied with the best, and every
    request of the model was a 500 (ZeroDivisionError) until the replica's next scrape. A
    value that is not a number says nothing about the load: ignored, requests go on."""
    odd, sane = await fake_replicas(2, kv_cache_usage=float("nan"), num_waiting=float("inf"))
    sane.kv_cache_usage, sane.num_waiting = 0.5, 1
    gw, url = await gateway(config(odd.url, sane.url, policy=policy))
    await gw.health.probe_all()
    assert all(r.scraped and r.healthy for r in gw.pools["tiny"].replicas)
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200, await resp.text()
    assert len(odd.requests) + len(sane.requests) == 4 and in_flight(gw) == [0, 0]
    odd_replica = gw.pools["tiny"].get(odd.url)
    assert (odd_replica.kv_cache_usage, odd_replica.num_waiting) == (0.0, 0.0)  # unscraped
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        assert resp.status == 200 and "NaN" not in await resp.text()


async def test_a_retry_after_that_is_not_a_finite_delay_is_not_believed(fake_replicas,
                                                                         gateway) -> None:
    """A replica's 429 saying `Retry-After: inf` (a proxy's, a misconfigured server's) was a
    500 (OverflowError rounding the wait for the client's own Retry-After), and the replica's
    cooldown never ended: every later request of the model was that 500 too. Now the value
    counts as unreadable (1 s), and a finite one is capped at MAX_RETRY_AFTER_S."""
    (r,) = await fake_replicas(1, fail_next=1, fail_status=429, fail_retry_after="inf")
    gw, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
            assert (resp.status, resp.headers.get("Retry-After")) == (429, "1")
            assert (await error_of(resp))["message"] == "injected failure"
        await asyncio.sleep(1.1)
        async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 200, await resp.text()
    assert in_flight(gw) == [0]
    assert [parse_retry_after(v) for v in ("nan", "-inf", "1e12", "2.5", "-3")] == [
        1.0, 1.0, MAX_RETRY_AFTER_S, 2.5, 0.0]


async def test_an_id_holding_path_characters_stays_one_path_segment(raw_replica, gateway) -> None:
    """`/v1/files/..%2F..%2Fready`: the id ("../../ready", decoded) is looked up as one path
    segment on each replica, never as a path that climbs out of /v1/files."""
    replica = await raw_replica(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    gw, url = await gateway(config(replica.url))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/files/..%2F..%2Fready") as resp:
            assert resp.status == 404, await resp.text()
            await error_of(resp)
    # (the other requests are the health checks' /ready and /metrics)
    assert b"GET /v1/files/..%2F..%2Fready HTTP/1.1" in replica.requests, replica.requests
