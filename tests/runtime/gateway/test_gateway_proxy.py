"""The proxy against small real HTTP replicas: streaming, errors, retries, disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import yarl
from aiohttp import web
from argosy_runtime.gateway.config import (
    CascadeConfig,
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
)
from fake_replica import Served
from gateway_helpers import eventually


def config(*routes: tuple[str, list[str]], policy: str = "round-robin", **kw) -> GatewayConfig:
    models = tuple(ModelRouteConfig(name=n, backends=tuple(urls), policy=policy) for n, urls in routes)
    kw.setdefault("health", HealthConfig(interval_s=60))  # probes only where a test wants them
    return GatewayConfig(models=models, **kw)


def sse_payloads(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


async def test_stream_relayed_byte_for_byte_and_incrementally(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1, chunk_delay=0.25, num_chunks=4)
    _, url = await gateway(config(("tiny", [r.url])))
    body = {"model": "tiny", "prompt": "hello", "stream": True, "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{r.url}/v1/completions", json=body) as resp:
            direct = await resp.read()
        t0 = time.monotonic()
        arrivals, via = [], b""
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["x-argosy-backend"] == r.url
            async for chunk in resp.content.iter_any():
                arrivals.append(time.monotonic() - t0)
                via += chunk
    assert via == direct
    assert sse_payloads(via)[-1] == "[DONE]"
    # Not buffered: the first event arrives long before the last (4 chunks x 0.25 s apart).
    assert len(arrivals) >= 3 and arrivals[-1] - arrivals[0] > 0.5


async def test_non_streamed_and_chat_pass_through(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(("tiny", [r.url])))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "abc"}) as resp:
            data = await resp.json()
    assert data["choices"][0]["message"]["content"] == "".join(r.text_of(i) for i in range(4))
    assert r.requests[-1] == body and r.headers_seen[-1]["X-Request-Id"] == "abc"


async def test_errors_unknown_model_bad_json_and_passthrough(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(("tiny", [r.url])))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}) as resp:
            assert resp.status == 404
            err = (await resp.json())["error"]
            assert err["param"] == "model" and "nope" in err["message"]
            assert (err["type"], err["code"]) == ("not_found_error", "model_not_found")
            assert set(err) == {"message", "type", "param", "code"}
        async with s.post(f"{url}/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400 and "error" in await resp.json()
        async with s.post(f"{url}/v1/completions", json=["a"]) as resp:
            assert resp.status == 400
        # One model served: `model` may be left out, as with the server itself.
        async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
            assert "model" not in r.requests[-1]
        # Validation the replica does is passed through unchanged, status and body.
        bad = {"model": "tiny", "prompt": "x", "temperature": -1}
        async with s.post(f"{r.url}/v1/completions", json=bad) as resp:
            direct = (resp.status, await resp.json())
        async with s.post(f"{url}/v1/completions", json=bad) as resp:
            assert (resp.status, await resp.json()) == direct
        async with s.get(f"{url}/v2/nothing") as resp:
            assert resp.status == 404 and "error" in await resp.json()


async def test_models_merged_across_backends_and_cascades(fake_replicas, gateway) -> None:
    (a,) = await fake_replicas(1, model="tiny")
    (b,) = await fake_replicas(1, model="big")
    cfg = config(("tiny", [a.url]), ("big", [b.url]),
                 cascades=(CascadeConfig(name="auto", small="tiny", large="big"),))
    _, url = await gateway(cfg)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as resp:
            data = await resp.json()
    assert sorted(m["id"] for m in data["data"]) == ["auto", "big", "tiny"]
    async with aiohttp.ClientSession() as s:
        # GET /v1/models/{id} (models.retrieve) answers each listed entry, cascades included.
        for entry in data["data"]:
            async with s.get(f"{url}/v1/models/{entry['id']}") as resp:
                assert resp.status == 200 and await resp.json() == entry
        async with s.get(f"{url}/v1/models/nope") as resp:
            error = (await resp.json())["error"]
            assert resp.status == 404 and error["code"] == "model_not_found"
        # Several models: `model` is required.
        async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "model"


async def test_a_model_id_with_a_slash_is_retrieved_as_the_openai_client_sends_it(
        fake_replicas, gateway) -> None:
    (a,) = await fake_replicas(1, model="org/tiny")
    _, url = await gateway(config(("org/tiny", [a.url])))
    async with aiohttp.ClientSession() as s:
        async with s.get(yarl.URL(f"{url}/v1/models/org%2Ftiny", encoded=True)) as resp:
            assert resp.status == 200 and (await resp.json())["id"] == "org/tiny"


async def test_refused_replica_is_retried_elsewhere_and_taken_out(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    await a.stop()  # now refuses connections
    gw, url = await gateway(config(("tiny", [a.url, b.url])))
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200
    assert len(b.requests) == 4
    assert not gw.pools["tiny"].get(a.url).healthy
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/metrics") as resp:
            text = await resp.text()
    assert 'argosy:gateway_retries_total{model="tiny",reason="connect_error"} 1.0' in text


async def test_5xx_before_first_byte_is_retried_once(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    a.fail_next = 1
    gw, url = await gateway(config(("tiny", [a.url, b.url])))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round-robin: one of the two lands on `a` first
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200
        async with s.get(f"{url}/metrics") as resp:
            text = await resp.text()
    # Three upstream requests for two client requests: the failed one was re-sent once.
    assert a.fail_next == 0 and len(a.requests) + len(b.requests) == 3 and b.completed >= 1
    assert 'argosy:gateway_retries_total{model="tiny",reason="upstream_5xx"} 1.0' in text
    # One 5xx is not yet enough to leave rotation (unhealthy_after=2).
    assert gw.pools["tiny"].get(a.url).healthy


async def test_a_request_the_runtime_fails_with_500_takes_no_replica_out_of_rotation(
        fake_replicas, gateway) -> None:
    # The runtime's own 500 (OpenAI-shaped: an exception on one request, a generation that
    # failed) is that request's failure; the replica's engine trouble answers 503. Counted
    # toward unhealthy_after, a client sending one such request twice took every replica
    # out of rotation (each try lands on another one) and everyone else got 503s.
    a, b = await fake_replicas(2)
    a.fail_next = b.fail_next = 2
    gw, url = await gateway(config(("tiny", [a.url, b.url])))
    pool = gw.pools["tiny"]
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 500  # retried on the other replica, which failed it too
        assert pool.get(a.url).healthy and pool.get(b.url).healthy
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 200
        # A 503 (engine dead, draining) still counts: twice in a row takes a replica out.
        a.fail_next = b.fail_next = 2
        a.fail_status = b.fail_status = 503
        for _ in range(2):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 503
        assert not pool.get(a.url).healthy and not pool.get(b.url).healthy


async def test_503_with_retry_after_keeps_the_replica_out_for_that_long(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    a.fail_next, a.fail_status, a.fail_retry_after = 1, 503, 30  # e.g. draining
    gw, url = await gateway(config(("tiny", [a.url, b.url])))
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200
    # `a` was tried at most once; afterwards it sat out its Retry-After window.
    assert len(a.requests) == 1 and a.completed == 0 and b.completed == 5


async def test_5xx_on_every_try_returns_the_last_error(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2, fail_next=5)
    _, url = await gateway(config(("tiny", [a.url, b.url])))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["message"] == "injected failure"
    # Exactly one retry: one request reached each replica.
    assert len(a.requests) == 1 and len(b.requests) == 1


async def test_replica_killed_before_first_byte_loses_no_request(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2, first_byte_delay=0.8, chunk_delay=0.01)
    gw, url = await gateway(config(("tiny", [a.url, b.url])))
    body = {"model": "tiny", "prompt": "x", "stream": True}

    async def call(s: aiohttp.ClientSession) -> bytes:
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.read()

    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(call(s)) for _ in range(4)]  # two on each replica
        await asyncio.sleep(0.3)
        assert len(a.requests) == 2 and len(b.requests) == 2
        await a.kill()  # headers sent, no body byte yet
        results = await asyncio.gather(*tasks)
    assert all(sse_payloads(r)[-1] == "[DONE]" for r in results)
    assert a.completed == 0 and b.completed == 4
    assert all(r.in_flight == 0 for r in gw.pools["tiny"].replicas)


async def test_client_disconnect_reaches_the_replica(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1, chunk_delay=0.2, num_chunks=20)
    gw, url = await gateway(config(("tiny", [r.url])))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        await resp.content.readany()
        resp.close()  # the client goes away mid-stream
    for _ in range(50):
        if r.disconnects:
            break
        await asyncio.sleep(0.05)
    assert r.disconnects == 1 and r.completed == 0
    assert gw.pools["tiny"].replicas[0].in_flight == 0


async def test_client_disconnect_while_waiting_for_first_byte(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1, first_byte_delay=5.0)
    gw, url = await gateway(config(("tiny", [r.url])))
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}))
        await asyncio.sleep(0.3)
        task.cancel()
    for _ in range(50):
        if r.disconnects:
            break
        await asyncio.sleep(0.05)
    assert r.disconnects == 1
    assert gw.pools["tiny"].replicas[0].in_flight == 0


async def wait_for_disconnects(replica, n: int) -> None:
    for _ in range(50):
        if replica.disconnects >= n:
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("slow_first", [True, False])
async def test_first_byte_timeout_retries_a_stalled_replica_elsewhere(fake_replicas, gateway,
                                                                       slow_first: bool) -> None:
    # Round-robin goes in URL order: the stalled replica comes first (tried by both requests)
    # or second (tried by the second request only, after the first went to `fast`).
    first, second = sorted(await fake_replicas(2), key=lambda r: r.url)
    slow, fast = (first, second) if slow_first else (second, first)
    slow.first_byte_delay = 30.0  # accepts, sends headers, then nothing
    gw, url = await gateway(config(("tiny", [slow.url, fast.url]), first_byte_timeout_s=0.5))
    async with aiohttp.ClientSession() as s:
        # `slow` stalls with no header (non-streamed) or after its headers (streamed).
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "x", "stream": stream}
            async with s.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-argosy-backend"] == fast.url
                await resp.read()
        async with s.get(f"{url}/metrics") as resp:
            text = await resp.text()
    tried = len(slow.requests)
    assert tried == (2 if slow_first else 1)
    await wait_for_disconnects(slow, tried)
    # Each stalled try was dropped (the replica saw its client leave), not left running.
    assert slow.disconnects == tried and slow.completed == 0 and fast.completed == 2
    assert ('argosy:gateway_retries_total{model="tiny",reason="first_byte_timeout"} '
            f"{float(tried)}") in text
    # Two failures in a row (unhealthy_after=2) take the hung replica out of rotation.
    assert gw.pools["tiny"].get(slow.url).healthy == (tried < 2)
    assert all(r.in_flight == 0 for r in gw.pools["tiny"].replicas)


async def test_first_byte_timeout_on_every_try_is_a_504(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1, first_byte_delay=30.0)
    gw, url = await gateway(config(("tiny", [r.url]), first_byte_timeout_s=0.3))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["type"] == "timeout_error"
    assert r.url in error["message"] and "first_byte_timeout_s (0.3 s)" in error["message"]
    await wait_for_disconnects(r, 1)
    assert r.disconnects == 1 and gw.pools["tiny"].replicas[0].in_flight == 0


async def test_first_byte_timeout_does_not_cut_an_answer_already_flowing(fake_replicas,
                                                                          gateway) -> None:
    # Slow between chunks (1.2 s in all) but the first byte in time: the deadline is only
    # on the first byte, so the stream runs to its end.
    (r,) = await fake_replicas(1, chunk_delay=0.3, num_chunks=4)
    _, url = await gateway(config(("tiny", [r.url]), first_byte_timeout_s=0.5))
    body = {"model": "tiny", "prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            raw = await resp.read()
    assert sse_payloads(raw)[-1] == "[DONE]" and r.completed == 1


async def test_retry_after_is_honoured(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    a.rate_limited = 30
    gw, url = await gateway(config(("tiny", [a.url, b.url])))
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200 and resp.headers["x-argosy-backend"] == b.url
        # `a` was asked once, then left alone for its Retry-After window.
        assert len(a.requests) == 1
        b.rate_limited = 10
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 429
            assert 1 <= int(resp.headers["Retry-After"]) <= 30
            assert (await resp.json())["error"]["code"] == 429
        # Both cooling down: the gateway answers 429 itself without asking either.
        before = len(a.requests) + len(b.requests)
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
        assert len(a.requests) + len(b.requests) == before


async def test_the_gateways_retry_after_is_never_shorter_than_the_wait(
        fake_replicas, gateway) -> None:
    # Rounded to the nearest second (2.3 s left -> "2"), a client honouring Retry-After came
    # back while every replica was still cooling down and got another 429.
    (r,) = await fake_replicas(1, rate_limited=3)
    gw, url = await gateway(config(("tiny", [r.url])))
    replica = gw.pools["tiny"].get(r.url)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 429  # the replica's, its Retry-After as the gateway counts it
            assert time.monotonic() + int(resp.headers["Retry-After"]) >= replica.cooldown_until
        await asyncio.sleep(0.7)  # 2.3 s of the 3 left
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 429  # the gateway's own: all replicas are cooling down
            assert time.monotonic() + int(resp.headers["Retry-After"]) >= replica.cooldown_until
    assert len(r.requests) == 1


async def test_unready_replica_leaves_rotation_and_is_probed_back(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    cfg = config(("tiny", [a.url, b.url]),
                 health=HealthConfig(interval_s=0.1, unhealthy_after=2, healthy_after=1))
    gw, url = await gateway(cfg)
    a.ready = False  # e.g. draining
    pool = gw.pools["tiny"]
    for _ in range(40):
        if not pool.get(a.url).healthy:
            break
        await asyncio.sleep(0.05)
    assert not pool.get(a.url).healthy
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.headers["x-argosy-backend"] == b.url
        a.ready = False
        b.ready = False
        await asyncio.sleep(0.4)
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 503
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "service_unavailable_error"
        a.ready = True
        b.ready = True
        await asyncio.sleep(0.4)
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 200
    assert pool.get(a.url).healthy


async def test_replicas_busy_with_a_retry_after_keep_the_gateway_ready(
        fake_replicas, gateway) -> None:
    # A replica whose queue is full (429 + Retry-After) is busy, not gone. /ready is the
    # gateway's own readiness probe: a 503 there during a load spike on one model pulled the
    # gateway from its Service, and every model's clients found no gateway at all.
    (busy,) = await fake_replicas(1, rate_limited=30)
    (other,) = await fake_replicas(1, model="other")
    gw, url = await gateway(config(("tiny", [busy.url]), ("other", [other.url])))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
        assert gw.pools["tiny"].available() == []  # cooling down: sent nothing meanwhile
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 200
            assert (await resp.json())["replicas_in_rotation"] == {"tiny": 1, "other": 1}
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 429  # the gateway's own, with the remaining wait
        assert len(busy.requests) == 1


async def test_least_load_reads_scraped_metrics(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    a.kv_cache_usage, a.num_waiting = 0.9, 3
    cfg = config(("tiny", [a.url, b.url]), policy="least-load", health=HealthConfig(interval_s=0.1))
    gw, url = await gateway(cfg)
    await asyncio.sleep(0.4)
    assert gw.pools["tiny"].get(a.url).kv_cache_usage == 0.9
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.headers["x-argosy-backend"] == b.url
        async with s.get(f"{url}/metrics") as resp:
            text = await resp.text()
    assert f'argosy:gateway_backend_kv_cache_usage_perc{{backend="{a.url}",model="tiny"}} 0.9' in text
    assert f'argosy:gateway_backend_num_requests_waiting{{backend="{a.url}",model="tiny"}} 3.0' in text


async def test_a_replica_whose_scrape_fails_does_not_look_idle(fake_replicas, gateway) -> None:
    # a answers /ready but no longer /metrics (as a swamped replica's slow scrape times out):
    # its last good scrape said idle. Kept, that stale 0 made least-load send a every request
    # while b, scraped fresh with 3 waiting, got none.
    a, b = await fake_replicas(2)
    cfg = config(("tiny", [a.url, b.url]), policy="least-load", health=HealthConfig(interval_s=0.1))
    gw, url = await gateway(cfg)
    ra, rb = gw.pools["tiny"].get(a.url), gw.pools["tiny"].get(b.url)

    async def both_scraped() -> bool:
        return ra.scraped and rb.scraped

    await eventually(both_scraped)
    a.metrics_status, a.num_waiting = 500, 50  # a is swamped, and nobody can see it
    b.num_waiting = 3

    async def b_scraped_and_a_not() -> bool:
        return rb.num_waiting == 3 and not ra.scraped

    await eventually(b_scraped_and_a_not)
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200
        # Unknown load: a is taken for as busy as b, so the two share the work.
        assert (len(a.requests), len(b.requests)) == (2, 2)
        a.metrics_status = 200  # scraped again: its real queue shows, and b takes the work

        async def a_scraped() -> bool:
            return ra.scraped and ra.num_waiting == 50

        await eventually(a_scraped)
        for _ in range(2):
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.headers["x-argosy-backend"] == b.url


async def test_prefix_affinity_keeps_a_prefix_on_one_replica(fake_replicas, gateway) -> None:
    rs = await fake_replicas(3)
    _, url = await gateway(config(("tiny", [r.url for r in rs]), policy="prefix-affinity"))
    prefixes = [f"You are assistant number {i}. Answer briefly and politely. " for i in range(6)]
    seen: dict[str, set[str]] = {p: set() for p in prefixes}
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            for p in prefixes:
                body = {"model": "tiny", "prompt": p + f"question {i}"}
                async with s.post(f"{url}/v1/completions", json=body) as resp:
                    seen[p].add(resp.headers["x-argosy-backend"])
    assert all(len(v) == 1 for v in seen.values())
    assert len(set().union(*seen.values())) >= 2  # different prefixes spread out


async def test_cascade_routes_and_reports(fake_replicas, gateway) -> None:
    (small,) = await fake_replicas(1, model="tiny", logprob=-0.2)
    (large,) = await fake_replicas(1, model="big")
    cascade = CascadeConfig(name="auto", small="tiny", large="big", keywords=("prove",),
                            min_mean_logprob=-1.0)
    _, url = await gateway(config(("tiny", [small.url]), ("big", [large.url]), cascades=(cascade,)))

    async def ask(s, prompt, **kw):
        body = {"model": "auto", "prompt": prompt, **kw}
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            return resp.status, resp.headers, await resp.read()

    async with aiohttp.ClientSession() as s:
        status, h, raw = await ask(s, "prove that 2+2=4")
        assert (status, h["x-argosy-cascade"], h["x-argosy-cascade-reason"]) == (200, "large", "keyword")
        assert large.requests[-1]["model"] == "big"
        # Confident small answer: small answers, and the logprobs the gateway asked for are gone.
        status, h, raw = await ask(s, "hello")
        assert (h["x-argosy-cascade"], h["x-argosy-cascade-reason"]) == ("small", "confident")
        assert float(h["x-argosy-cascade-confidence"]) == -0.2
        assert small.requests[-1]["logprobs"] == 0 and json.loads(raw)["choices"][0]["logprobs"] is None
        # Unsure small answer: asked again on the large model.
        small.logprob = -2.5
        n_large = len(large.requests)
        status, h, raw = await ask(s, "hello again")
        assert (h["x-argosy-cascade"], h["x-argosy-cascade-reason"]) == ("large", "low_confidence")
        assert len(large.requests) == n_large + 1 and json.loads(raw)["model"] == "big"
        # Streams skip the check; the header forces a tier.
        status, h, raw = await ask(s, "hello", stream=True)
        assert (h["x-argosy-cascade"], h["x-argosy-cascade-reason"]) == ("small", "default")
        async with s.post(f"{url}/v1/completions", json={"model": "auto", "prompt": "x"},
                          headers={"x-argosy-cascade": "large"}) as resp:
            assert resp.headers["x-argosy-cascade-reason"] == "header"
        async with s.post(f"{url}/v1/completions", json={"model": "auto:large", "prompt": "x"}) as resp:
            assert resp.headers["x-argosy-cascade-reason"] == "model_name"
        async with s.get(f"{url}/metrics") as resp:
            text = await resp.text()
    for tier, reason in [("large", "keyword"), ("small", "confident"), ("large", "low_confidence"),
                         ("small", "default"), ("large", "header"), ("large", "model_name")]:
        line = f'argosy:gateway_cascade_decisions_total{{reason="{reason}",route="auto",tier="{tier}"}} 1.0'
        assert line in text, line


async def test_cascade_falls_back_to_large_when_small_cannot_take_the_request(
        fake_replicas, gateway) -> None:
    """The small model's replicas all failing (5xx after the retries) or its pool empty is no
    answer: a request the rules sent there goes to the large model (`small_unavailable`),
    streamed or not, with or without the confidence check; a client that asked for the small
    model gets its error."""
    (small,) = await fake_replicas(1, model="tiny", logprob=-0.2)
    (large,) = await fake_replicas(1, model="big")
    checked = CascadeConfig(name="auto", small="tiny", large="big", min_mean_logprob=-1.0)
    plain = CascadeConfig(name="plain", small="tiny", large="big")
    _, url = await gateway(config(("tiny", [small.url]), ("big", [large.url]),
                                  cascades=(checked, plain), max_attempts=1))
    async with aiohttp.ClientSession() as s:
        # A client's mistake is the same on either model: passed through, not retried large.
        small.fail_next, small.fail_status = 1, 400
        async with s.post(f"{url}/v1/completions", json={"model": "plain", "prompt": "x"}) as resp:
            assert resp.status == 400 and resp.headers["x-argosy-cascade"] == "small"
        assert not large.requests
        for route, extra in (("auto", {}), ("auto", {"stream": True}), ("plain", {})):
            small.fail_next, small.fail_status = 1, 503
            n_large = len(large.requests)
            async with s.post(f"{url}/v1/completions",
                              json={"model": route, "prompt": "hello", **extra}) as resp:
                await resp.read()
                assert resp.status == 200, (route, extra)
                assert (resp.headers["x-argosy-cascade"],
                        resp.headers["x-argosy-cascade-reason"]) == ("large", "small_unavailable")
            assert len(large.requests) == n_large + 1 and large.requests[-1]["model"] == "big"
        # Forced to the small tier: its error, not the large model's answer.
        small.fail_next = 1
        n_large = len(large.requests)
        async with s.post(f"{url}/v1/completions", json={"model": "auto:small", "prompt": "x"}) as resp:
            assert resp.status == 503 and resp.headers["x-argosy-cascade"] == "small"
        assert len(large.requests) == n_large
        async with s.get(f"{url}/metrics") as resp:
            text = await resp.text()
    assert ('argosy:gateway_cascade_decisions_total{reason="small_unavailable",route="auto",'
            'tier="large"} 2.0') in text


async def test_lora_adapters_route_to_their_base_models_replicas(fake_replicas, gateway) -> None:
    (a,) = await fake_replicas(1, model="tiny")
    (b,) = await fake_replicas(1, model="big")
    a.adapters = ["sql"]
    _, url = await gateway(config(("tiny", [a.url]), ("big", [b.url])))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}) as resp:
            assert resp.status == 200 and resp.headers["x-argosy-backend"] == a.url
        assert a.requests[-1]["model"] == "sql" and not b.requests  # name unchanged
        async with s.get(f"{url}/v1/models") as resp:
            models = {m["id"]: m for m in (await resp.json())["data"]}
        assert models["sql"]["parent"] == "tiny"
        async with s.get(f"{url}/v1/models/sql") as resp:  # an adapter, from its replica
            assert resp.status == 200 and await resp.json() == models["sql"]
        async with s.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}) as resp:
            assert resp.status == 404


async def test_new_adapters_requested_together_all_find_their_replica(fake_replicas,
                                                                      gateway) -> None:
    """Adapters loaded after the last health check are looked up in /v1/models; requests
    for several new names that arrive during one lookup wait for it (before, all but the
    first were answered 404 for the next second)."""
    (a,) = await fake_replicas(1, model="tiny")
    _, url = await gateway(config(("tiny", [a.url])))
    a.adapters = [f"new-{i}" for i in range(6)]  # after the gateway's first scrape
    a.models_delay = 0.2
    async with aiohttp.ClientSession() as s:
        async def status(model: str) -> int:
            async with s.post(f"{url}/v1/completions", json={"model": model, "prompt": "x"}) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(*(status(name) for name in a.adapters)) == [200] * 6
        assert await status("never-served") == 404


@pytest.mark.parametrize("listed_as", ["adapters", "registered_adapters"])
async def test_adapter_requests_go_to_the_replicas_that_serve_the_adapter(
        fake_replicas, gateway, listed_as: str) -> None:
    """Adapters come and go while replicas run (--lora-modules-file, /v1/load_lora_adapter):
    the gateway reads each replica's `argosy:lora_adapter_loaded` and skips replicas without
    the adapter, so none answers 404 while others have it. A replica with --max-loaded-loras
    lists an adapter it has not loaded yet only in `argosy:lora_adapter_registered` (it loads
    it on the first request), so that family counts too."""
    has, lacks = await fake_replicas(2, model="tiny")
    setattr(has, listed_as, ["sql"])
    gw, url = await gateway(config(("tiny", [has.url, lacks.url]), policy="round-robin"))
    await gw.health.probe_all()
    assert gw.pools["tiny"].get(has.url).adapters == {"sql"}
    assert gw.pools["tiny"].get(lacks.url).adapters == frozenset()
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}) as r:
                assert r.status == 200 and r.headers["x-argosy-backend"] == has.url
        backends = set()
        for _ in range(4):  # the base model still uses both
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as r:
                backends.add(r.headers["x-argosy-backend"])
        assert backends == {has.url, lacks.url}
        # Unloaded everywhere: a replica says the model does not exist, as the server would.
        setattr(has, listed_as, [])
        await gw.health.probe_all()
        async with s.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}) as r:
            assert r.status == 404


async def test_adapter_requests_prefer_the_replica_with_the_adapter_loaded(
        fake_replicas, gateway) -> None:
    """Of two replicas serving an adapter, the one listing it in `argosy:lora_adapter_loaded`
    takes its requests; the one with it only in `argosy:lora_adapter_registered` would load it
    first (--max-loaded-loras). Once the loaded one is far busier, the other takes the next."""
    loaded, registered, lacks = await fake_replicas(3, model="tiny")
    loaded.adapters = ["sql"]
    registered.registered_adapters = ["sql"]
    gw, url = await gateway(config(("tiny", [loaded.url, registered.url, lacks.url]),
                                   policy="round-robin"))
    await gw.health.probe_all()
    pool = gw.pools["tiny"]
    assert pool.get(loaded.url).loaded_adapters == {"sql"}
    assert pool.get(registered.url).loaded_adapters == frozenset()
    assert pool.get(registered.url).adapters == {"sql"}
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}) as r:
                assert r.status == 200 and r.headers["x-argosy-backend"] == loaded.url
        # Four requests in flight there (min_capacity) and none on the other: it spills.
        pool.get(loaded.url).in_flight = 4
        async with s.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}) as r:
            assert r.status == 200 and r.headers["x-argosy-backend"] == registered.url
    assert not lacks.requests


class _StoringReplica(Served):
    """A replica holding the stored response `resp_1`, and full (429, Retry-After: 30) for
    new generations."""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/responses/{id}", self._stored)
        app.router.add_post("/v1/responses", self._full)
        self.posted = 0
        await self._serve(app)

    async def _ready(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    async def _stored(self, request: web.Request) -> web.Response:
        if request.match_info["id"] != "resp_1":
            return web.json_response({"error": {"message": "no such response"}}, status=404)
        return web.json_response({"id": "resp_1", "object": "response"})

    async def _full(self, request: web.Request) -> web.Response:
        self.posted += 1
        return web.json_response({"error": {"message": "queue full", "type": "rate_limit_error"}},
                                 status=429, headers={"Retry-After": "30"})


async def test_a_busy_replicas_stored_responses_are_not_answered_404(
        fake_replicas, gateway) -> None:
    # A replica whose queue is full (429 + Retry-After) still holds its stored responses:
    # calls on them were answered 404 ("no response with id ... on any replica"), and a
    # follow-up to one 404 previous_response_not_found (or, with another replica idle, 503
    # "no replica"), which clients take as gone for good.
    r = _StoringReplica()
    await r.start()
    try:
        (idle,) = await fake_replicas(1)
        gw, url = await gateway(config(("tiny", [r.url, idle.url])))
        gw.pools["tiny"].get(r.url).set_retry_after(30)  # as its 429's Retry-After does
        follow_up = {"model": "tiny", "input": "and then?", "previous_response_id": "resp_1"}
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/responses/resp_1") as resp:
                assert resp.status == 200 and (await resp.json())["id"] == "resp_1"
            async with s.post(f"{url}/v1/responses", json=follow_up) as resp:
                assert resp.status == 429, await resp.text()
                assert 29 <= int(resp.headers["Retry-After"]) <= 30
            async with s.get(f"{url}/v1/responses/resp_2") as resp:
                assert resp.status == 404  # an id no replica holds still is one
        assert r.posted == 0 and idle.requests == []  # the follow-up waits for its replica
    finally:
        await r.stop()
