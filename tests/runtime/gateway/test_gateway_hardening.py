"""Leftovers of the gateway's hardening: an OpenAI-shaped 500 for its own bugs, answers cut
short counted in argosy:gateway_requests_total, bounded least-load weights, a timeout for a
request body that stops arriving, and a label selector checked at start-up."""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial

import aiohttp
import openai
import pytest
from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import GatewayConfig, KubernetesBackendConfig, RoutingConfig
from argosy_runtime.gateway.policies import LeastLoadPolicy, RouteRequest
from argosy_runtime.gateway.proxy import app as gateway_app
from gateway_helpers import counts_a_499_not_a_200, eventually, requests_total, tiny_config

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
ERROR_FIELDS = {"message", "type", "param", "code"}
config = partial(tiny_config, policy="round-robin")  # the model `tiny` on these backends


# -- 1. an unexpected exception is an OpenAI-shaped 500 ---------------------------------------


@pytest.mark.parametrize(("raised", "status", "err_type"), [
    (RuntimeError("boom"), 500, "internal_server_error"),
    # aiohttp answers an unhandled TimeoutError with a 504: the status stays, the shape is ours
    (TimeoutError(), 504, "timeout_error"),
])
async def test_a_bug_in_the_gateway_is_an_openai_error_and_its_traceback_is_logged(
        fake_replicas, gateway, monkeypatch, caplog, raised, status, err_type) -> None:
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url))

    def broken(*_, **__):
        raise raised

    monkeypatch.setattr(gateway_app, "routing_text", broken)  # called for every routed request
    with caplog.at_level(logging.ERROR, logger=gateway_app.logger.name):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json=COMPLETION) as resp:
                assert resp.status == status
                assert resp.content_type == "application/json", await resp.text()
                error = (await resp.json())["error"]
            # Client errors still are what they were, not hidden behind the 500.
            async with s.get(f"{url}/v1/completions") as resp:
                assert resp.status == 405
            async with s.post(f"{url}/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
    assert set(error) == ERROR_FIELDS and error["type"] == err_type
    assert "boom" not in error["message"]  # nothing of the exception leaks to the client
    logged = [rec for rec in caplog.records if rec.exc_info is not None]
    assert logged and logged[0].exc_info[1] is raised and "/v1/completions" in logged[0].getMessage()
    assert r.requests == [] and gw.pools["tiny"].replicas[0].in_flight == 0


async def test_a_body_that_does_not_decode_is_the_clients_400_not_a_gateway_bug(
        fake_replicas, gateway, caplog) -> None:
    """A request body aiohttp cannot read (a Content-Encoding that does not decode) is the
    client's error: a 400, not a 500 logged as a bug in the gateway."""
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(r.url))
    with caplog.at_level(logging.INFO):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", data=b"not gzip at all",
                              headers={"Content-Encoding": "gzip",
                                       "Content-Type": "application/json"}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error"
    assert "gzip" in error["message"]
    assert not [rec for rec in caplog.records  # nothing logged as the gateway's bug
                if rec.levelno >= logging.ERROR and rec.name.startswith("argosy_runtime")]
    assert r.requests == []


async def test_the_openai_client_reads_the_gateways_500(fake_replicas, gateway,
                                                        monkeypatch) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(r.url))
    monkeypatch.setattr(gateway_app, "routing_text", lambda *_: 1 / 0)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            await client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    finally:
        await client.close()
    assert exc.value.status_code == 500
    assert exc.value.body["type"] == "internal_server_error"
    assert "internal server error" in exc.value.message


async def test_a_bug_after_the_answer_started_cuts_the_connection(fake_replicas, gateway,
                                                                  monkeypatch) -> None:
    """Once the status line went out, a second answer cannot follow: the connection is cut
    (the client sees a broken body, never a 200 that looks whole) and it counts as a 500."""
    (r,) = await fake_replicas(1, num_chunks=4)
    gw, url = await gateway(config(r.url))

    class BrokenMeter:
        def feed(self, chunk: bytes) -> None:
            raise RuntimeError("meter bug")

        def finish(self) -> None:
            pass

    monkeypatch.setattr(gw.tenants, "meter", lambda *_: BrokenMeter())
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert await requests_total(s, url, model="tiny", backend=r.url, code="500") == 1
        assert await requests_total(s, url, model="tiny", backend=r.url, code="200") == 0
    assert gw.pools["tiny"].replicas[0].in_flight == 0


# -- 2. answers cut short are counted --------------------------------------------------------


async def test_a_stream_whose_replica_dies_mid_way_counts_as_a_502(fake_replicas,
                                                                   gateway) -> None:
    (r,) = await fake_replicas(1, num_chunks=50, chunk_delay=0.05)
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the first event is through
            await r.kill()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert await requests_total(s, url, model="tiny", backend=r.url, code="502") == 1
        assert await requests_total(s, url, model="tiny", backend=r.url, code="200") == 0


async def test_a_stream_whose_client_leaves_mid_way_counts_as_a_499(fake_replicas,
                                                                    gateway) -> None:
    (r,) = await fake_replicas(1, num_chunks=50, chunk_delay=0.05)
    gw, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        resp.close()  # the client goes away mid-stream
        await counts_a_499_not_a_200(s, url, r.url)
    await eventually(lambda: asyncio.sleep(0, r.disconnects == 1))
    assert gw.pools["tiny"].replicas[0].in_flight == 0


async def test_a_client_that_leaves_before_the_first_byte_counts_as_a_499(fake_replicas,
                                                                          gateway) -> None:
    (r,) = await fake_replicas(1, first_byte_delay=5.0)
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            await s.post(f"{url}/v1/completions", json=COMPLETION,
                         timeout=aiohttp.ClientTimeout(total=0.3))

        async def counted() -> bool:
            return await requests_total(s, url, model="tiny", backend="", code="499") == 1

        await eventually(counted)


async def test_a_whole_stream_still_counts_once_with_its_status(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(r.url))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        assert await requests_total(s, url, model="tiny", backend=r.url, code="200") == 1
        for code in ("499", "502", "500"):
            assert await requests_total(s, url, model="tiny", backend=r.url, code=code) == 0


# -- 3. least-load weights stay finite ---------------------------------------------------------


@pytest.mark.parametrize("weight", ["w_in_flight", "w_waiting", "w_kv"])
@pytest.mark.parametrize("value", [1e308, float("inf"), 1e6 + 1])
def test_a_least_load_weight_past_the_bound_is_refused_at_start_up(weight: str,
                                                                   value: float) -> None:
    with pytest.raises(ValueError, match=rf"^routing\.{weight}: must be <= 1e\+06"):
        GatewayConfig.from_dict({"routing": {weight: value}})


def test_the_largest_weights_keep_least_load_ordering() -> None:
    policy = LeastLoadPolicy(RoutingConfig(w_in_flight=1e6, w_waiting=1e6, w_kv=1e6))
    a, b, c = (Replica(url=f"http://r{i}") for i in range(3))
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert [policy.choose([a, b, c], RouteRequest()) for _ in range(3)] == [b, b, b]
    # Scraped gauges are finite (health.py drops others), but may be absurd: scores that
    # overflow to inf all tie, and the rotation goes on instead of failing.
    for replica in (a, b, c):
        replica.num_waiting = 1e305
    picks = [policy.choose([a, b, c], RouteRequest()) for _ in range(6)]
    assert {p.url for p in picks} == {a.url, b.url, c.url}


# -- 4. a request body that stops arriving ------------------------------------------------------


async def raw_post(port: int, head_extra: bytes, parts: list[tuple[bytes, float]],
                   length: int) -> bytes:
    """POST /v1/completions announcing `length` body bytes and sending `parts` (bytes, then a
    pause in seconds); everything the gateway answered until it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n" % length + head_extra + b"\r\n")
    for data, pause in parts:
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(pause)
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes(
        fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    gw, url = await gateway(config(r.url, client_body_timeout_s=0.4))
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(COMPLETION).encode()
    loop = asyncio.get_running_loop()
    started = loop.time()
    # Half the body, then nothing more: the gateway must not wait forever.
    answer = await raw_post(port, b"", [(body[:10], 0)], len(body))
    waited = loop.time() - started
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"Connection: close" in head
    error = json.loads(payload)["error"]
    assert set(error) == ERROR_FIELDS
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    assert "0.4 s" in error["message"]
    assert 0.4 <= waited < 3  # caught within 1.25x of the timeout, plus scheduling slack
    assert r.requests == [] and gw.pools["tiny"].replicas[0].in_flight == 0


async def test_a_body_that_keeps_arriving_slowly_is_not_cut(fake_replicas, gateway) -> None:
    """The timeout is between reads (nginx's client_body_timeout), not for the whole body:
    a slow upload that keeps coming gets through."""
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(r.url, client_body_timeout_s=0.4))
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(COMPLETION).encode()
    pieces = [(body[i:i + 8], 0.2) for i in range(0, len(body), 8)]  # over a second in all
    assert len(pieces) * 0.2 > 0.8
    answer = await raw_post(port, b"Connection: close\r\n", pieces, len(body))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert r.requests == [COMPLETION]


async def test_the_body_timeout_is_a_config_field() -> None:
    assert GatewayConfig().client_body_timeout_s == 60.0
    assert GatewayConfig.from_dict({"client_body_timeout_s": 5}).client_body_timeout_s == 5
    for bad in (0, -1, "60s", float("nan")):
        with pytest.raises(ValueError, match=r"^client_body_timeout_s"):
            GatewayConfig.from_dict({"client_body_timeout_s": bad})


# -- 5. label_selector --------------------------------------------------------------------------


@pytest.mark.parametrize("selector", [5, ["app=x"], {"app": "x"}, True, "", "   "])
def test_a_label_selector_that_is_not_a_selector_string_stops_the_start(selector) -> None:
    """It used to pass, and discovery then failed every list call and retried forever."""
    with pytest.raises(ValueError, match=r"^kubernetes\.label_selector: expected a Kubernetes "
                                         r"label selector string"):
        GatewayConfig.from_dict({"models": [{"name": "a", "kubernetes": {
            "llmdeployment": "a", "label_selector": selector}}]})


@pytest.mark.parametrize(("field", "value"), [("namespace", None), ("llmdeployment", ["a"]),
                                              ("port_name", 8000), ("api_url", 1),
                                              # in every API path: these fail every call
                                              ("namespace", ""), ("namespace", "a/b"),
                                              ("namespace", "LLM ")])
def test_other_kubernetes_strings_are_checked_too(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^kubernetes\.{field}: expected a"):
        KubernetesBackendConfig(**{"llmdeployment": "a", field: value})


def test_a_label_selector_string_is_used_as_given() -> None:
    k = KubernetesBackendConfig(label_selector="app=llm,tier in (a,b)")
    assert k.selector == "app=llm,tier in (a,b)"
    assert KubernetesBackendConfig(llmdeployment="big").selector == "argosy.dev/llmdeployment=big"
