"""Tenants through the proxy, against small real HTTP replicas: keys, limits, charging, headers,
metrics; every way a request ends releases its lease."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from argosy_runtime.gateway.config import (
    CascadeConfig,
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    TenantConfig,
)

KEY_A, KEY_B = "sk-team-a-secret", "sk-team-b-secret"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def config(urls: list[str], *tenants: TenantConfig, **kw) -> GatewayConfig:
    kw.setdefault("tenants", tenants or (TenantConfig(name="a", api_keys=(KEY_A,)),))
    return GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=tuple(urls), policy="round-robin"),),
        health=HealthConfig(interval_s=60), **kw)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def metric(s: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)  # labels optional
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == wanted:
            return float(m.group(3))
    return 0.0


async def test_keys_are_required_on_v1_and_replaced_before_the_replica(fake_replicas,
                                                                       gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url], replica_api_key="replica-secret"))
    async with aiohttp.ClientSession() as s:
        for headers in ({}, auth("sk-wrong"), {"Authorization": KEY_A}):
            async with s.post(f"{url}/v1/completions", json=BODY, headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                error = (await resp.json())["error"]
                assert error["type"] == "authentication_error"
                assert error["code"] == "invalid_api_key"
                assert "sk-" not in json.dumps(error)
        for path in ("/v1/models", "/v1/files", "/v1/batches", "/v1/batches/batch_x",
                     "/v1/responses/resp_x", "/v1/nowhere"):
            async with s.get(f"{url}{path}") as resp:
                assert resp.status == 401, path
        assert not r.requests  # nothing unauthenticated reached the replica
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapes need no key
            async with s.get(f"{url}{path}") as resp:
                assert resp.status == 200, path
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
        async with s.get(f"{url}/v1/models", headers=auth(KEY_A)) as resp:
            assert resp.status == 200
        async with s.get(f"{url}/metrics") as resp:
            page = await resp.text()
    # The replica got the gateway's replica key, never the tenant's.
    assert r.headers_seen[-1]["Authorization"] == "Bearer replica-secret"
    assert KEY_A not in page and 'tenant="a"' in page


async def test_without_a_replica_key_no_authorization_reaches_the_replica(fake_replicas,
                                                                         gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url]))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
    assert "Authorization" not in r.headers_seen[-1]


async def test_without_tenants_authorization_passes_through(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url], tenants=(), replica_api_key="replica-secret"))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=BODY) as resp:
            assert resp.status == 200
            assert not any(h.startswith("x-ratelimit") for h in resp.headers)
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth("client")) as resp:
            assert resp.status == 200
    assert "Authorization" not in r.headers_seen[0]
    assert r.headers_seen[1]["Authorization"] == "Bearer client"


async def test_requests_per_minute_gives_429_with_retry_after(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    tenants = (TenantConfig(name="a", api_keys=(KEY_A,), requests_per_minute=2),
               TenantConfig(name="b", api_keys=(KEY_B,)))
    _, url = await gateway(config([r.url], *tenants))
    async with aiohttp.ClientSession() as s:
        for remaining in ("1", "0"):
            async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
                assert resp.status == 200
                assert resp.headers["x-ratelimit-limit-requests"] == "2"
                assert resp.headers["x-ratelimit-remaining-requests"] == remaining
                assert resp.headers["x-ratelimit-reset-requests"].endswith("s")
                assert "x-ratelimit-limit-tokens" not in resp.headers  # no tokens limit
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 429
            assert 25 <= int(resp.headers["Retry-After"]) <= 30  # one request per 30 s
            assert resp.headers["x-ratelimit-remaining-requests"] == "0"
            error = (await resp.json())["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "'a'" in error["message"] and "requests per minute" in error["message"]
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_B)) as resp:
            assert resp.status == 200  # another tenant is not held back
            assert not any(h.startswith("x-ratelimit") for h in resp.headers)
        assert len(r.requests) == 3
        assert await metric(s, url, "argosy:gateway_tenant_rate_limited_total", tenant="a",
                            limit="requests") == 1
        assert await metric(s, url, "argosy:gateway_tenant_requests_total", tenant="a",
                            code="429") == 1
        assert await metric(s, url, "argosy:gateway_tenant_requests_total", tenant="a",
                            code="200") == 2


async def test_tokens_are_charged_from_usage_and_debt_holds_the_tenant_back(fake_replicas,
                                                                           gateway) -> None:
    (r,) = await fake_replicas(1, prompt_tokens=100)
    tenant = TenantConfig(name="a", api_keys=(KEY_A,), tokens_per_minute=60)  # 1 a second
    gw, url = await gateway(config([r.url], tenant))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
            # As the limits stood when the request came: full.
            assert resp.headers["x-ratelimit-remaining-tokens"] == "60"
            assert resp.headers["x-ratelimit-reset-tokens"] == "0s"
            await resp.read()
        # 104 tokens charged: 44 of debt, so the next request waits ~45 s.
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 429
            assert 40 <= int(resp.headers["Retry-After"]) <= 45
            assert resp.headers["x-ratelimit-remaining-tokens"] == "0"
            assert "tokens per minute" in (await resp.json())["error"]["message"]
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == 100
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="completion") == 4
        assert await metric(s, url, "argosy:gateway_tenant_rate_limited_total", tenant="a",
                            limit="tokens") == 1
    tokens = gw.tenants.limiters["a"].tokens
    assert tokens is not None and -44 <= tokens.level < -40


async def test_streams_charge_the_usage_the_gateway_asks_for(fake_replicas, gateway) -> None:
    """A stream is charged its reported usage, also when the client did not ask for it: the
    gateway asks (one content chunk may carry many tokens: speculative decoding, beam
    search) and the client gets the stream it asked for, without the usage event."""
    (r,) = await fake_replicas(1, prompt_tokens=50, num_chunks=3, chunk_delay=0.0)
    _, url = await gateway(config([r.url]))
    async with aiohttp.ClientSession() as s:
        with_usage = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{url}/v1/completions", json=with_usage, headers=auth(KEY_A)) as resp:
            raw = await resp.read()
        assert b'"usage"' in raw and raw.endswith(b"data: [DONE]\n\n")
        for without in ({**BODY, "stream": True},
                        {**BODY, "stream": True, "stream_options": {"include_usage": False}}):
            async with s.post(f"{url}/v1/completions", json=without,
                              headers=auth(KEY_A)) as resp:
                raw = await resp.read()
            assert b'"usage"' not in raw and raw.count(b"data: ") == 3 + 1  # chunks, [DONE]
            assert raw.endswith(b"\n\ndata: [DONE]\n\n")
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == 3 * 50
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="completion") == 3 * 3


def test_the_usage_event_is_removed_across_chunk_boundaries() -> None:
    from argosy_runtime.gateway.proxy.asked_usage import UsageEventRemover

    stream = (b'data: {"choices": [{"text": "a"}]}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 5}}\n\ndata: [DONE]\n\n')
    want = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(stream)):
        remover = UsageEventRemover()
        out = b"".join(remover(stream[i:i + size]) for i in range(0, len(stream), size))
        assert out + remover.rest() == want, size


async def test_concurrency_slots_come_back_on_every_path(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1, chunk_delay=0.2, num_chunks=5)
    tenant = TenantConfig(name="a", api_keys=(KEY_A,), max_concurrent=1)
    gw, url = await gateway(config([r.url], tenant))
    limiter = gw.tenants.limiters["a"]
    stream = {**BODY, "stream": True}
    async with aiohttp.ClientSession() as s:

        async def complete(body: dict) -> int:
            async with s.post(f"{url}/v1/completions", json=body, headers=auth(KEY_A)) as resp:
                await resp.read()
                return resp.status

        # 1. answered: a second request while the first runs is refused, then admitted.
        first = asyncio.create_task(complete(BODY))
        await asyncio.sleep(0.3)
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert "max_concurrent" in (await resp.json())["error"]["message"]
        assert await first == 200 and limiter.in_flight == 0

        # 2. the client goes away mid-stream: the slot comes back, what it got is charged.
        resp = await s.post(f"{url}/v1/completions", json=stream, headers=auth(KEY_A))
        await resp.content.readany()
        resp.close()
        for _ in range(100):
            if limiter.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert limiter.in_flight == 0
        assert await metric(s, url, "argosy:gateway_tenant_requests_total", tenant="a",
                            code="499") == 1
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="completion") >= 4 + 1

        # 3. the replica dies mid-answer: the slot comes back too.
        task = asyncio.create_task(complete(stream))
        await asyncio.sleep(0.3)
        await r.kill()
        try:
            await task
        except aiohttp.ClientError:
            pass  # the client's connection is cut: the answer was not complete
        assert limiter.in_flight == 0

        # 4. no replica at all (503 before anything was relayed): released, nothing charged.
        before = await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                              kind="completion")
        assert await complete(BODY) == 503 and limiter.in_flight == 0
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="completion") == before
        # 5. the gateway's own errors (unknown model, bad JSON) release it as well.
        assert await complete({**BODY, "model": "nope"}) == 404 and limiter.in_flight == 0
        async with s.post(f"{url}/v1/completions", data=b"{", headers=auth(KEY_A)) as resp:
            assert resp.status == 400
        assert limiter.in_flight == 0


async def test_a_request_retried_on_another_replica_counts_once(fake_replicas, gateway) -> None:
    replicas = await fake_replicas(2)
    tenant = TenantConfig(name="a", api_keys=(KEY_A,), requests_per_minute=6)
    gw, url = await gateway(config([r.url for r in replicas], tenant))
    # Round-robin: the first try of request 1 (and of request 2) goes to the pool's first.
    tried_first = next(r for r in replicas if r.url == gw.pools["tiny"].replicas[0].url)
    other = next(r for r in replicas if r is not tried_first)
    async with aiohttp.ClientSession() as s:
        tried_first.fail_next = 1  # a 500 before the first byte: retried on the other
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200 and resp.headers["x-argosy-backend"] == other.url
            await resp.read()
        await tried_first.stop()  # refused: retried on the other
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200 and resp.headers["x-argosy-backend"] == other.url
            await resp.read()
        for reason in ("upstream_5xx", "connect_error"):
            assert await metric(s, url, "argosy:gateway_retries_total", model="tiny",
                                reason=reason) == 1
        assert await metric(s, url, "argosy:gateway_tenant_requests_total", tenant="a",
                            code="200") == 2
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == 2 * 10  # a failed try relays nothing
    requests = gw.tenants.limiters["a"].requests  # 2 taken, refilling at 0.1 a second
    assert requests is not None and 4 <= requests.level < 4.5


async def test_models_and_the_batch_api_need_the_key_but_are_not_charged(fake_replicas,
                                                                         gateway) -> None:
    (r,) = await fake_replicas(1)
    tenant = TenantConfig(name="a", api_keys=(KEY_A,), requests_per_minute=1,
                          max_concurrent=1)
    _, url = await gateway(config([r.url], tenant))
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.get(f"{url}/v1/models", headers=auth(KEY_A)) as resp:
                assert resp.status == 200
                assert resp.headers["x-ratelimit-remaining-requests"] == "1"
            async with s.get(f"{url}/v1/batches", headers=auth(KEY_A)) as resp:
                assert resp.status == 200  # the merged (empty) list
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
        assert await metric(s, url, "argosy:gateway_tenant_requests_total", tenant="a",
                            code="200") == 7


async def test_a_cascade_answer_is_charged(fake_replicas, gateway) -> None:
    (small,) = await fake_replicas(1, model="small", prompt_tokens=7)
    (large,) = await fake_replicas(1, model="large")
    models = (ModelRouteConfig(name="small", backends=(small.url,)),
              ModelRouteConfig(name="large", backends=(large.url,)))
    cascade = CascadeConfig(name="auto", small="small", large="large", min_mean_logprob=-1.0)
    gw = GatewayConfig(models=models, cascades=(cascade,), health=HealthConfig(interval_s=60),
                       tenants=(TenantConfig(name="a", api_keys=(KEY_A,)),))
    _, url = await gateway(gw)
    async with aiohttp.ClientSession() as s:
        body = {"model": "auto", "prompt": "hello", "max_tokens": 4}
        async with s.post(f"{url}/v1/completions", json=body, headers=auth(KEY_A)) as resp:
            assert resp.status == 200 and resp.headers["x-argosy-cascade"] == "small"
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == 7


async def test_a_rotated_keys_file_applies_without_a_restart(fake_replicas, gateway,
                                                             tmp_path) -> None:
    (r,) = await fake_replicas(1, prompt_tokens=5)
    keys_file = tmp_path / "team-a"
    keys_file.write_text(f"{KEY_A}\n")
    rotated = "sk-team-a-rotated"
    tenants = (TenantConfig(name="a", api_keys_file=str(keys_file), requests_per_minute=4),
               TenantConfig(name="b", api_keys=(KEY_B,)))
    _, url = await gateway(config([r.url], *tenants), keys_poll_s=0.05)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
            assert resp.headers["x-ratelimit-remaining-requests"] == "3"
        async with s.get(f"{url}/v1/models", headers=auth(rotated)) as resp:
            assert resp.status == 401  # not a key yet
        keys_file.write_text(f"{rotated}\n")  # the old key removed, a new one added
        for _ in range(200):  # /v1/models: needs a key, takes nothing from the budget
            async with s.get(f"{url}/v1/models", headers=auth(rotated)) as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.02)
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(rotated)) as resp:
            assert resp.status == 200
            # The tenant's bucket carried on: one request left it 3, this one leaves 2.
            assert resp.headers["x-ratelimit-remaining-requests"] == "2"
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 401
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_B)) as resp:
            assert resp.status == 200  # other tenants untouched
        assert len(r.requests) == 3
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == 10  # both keys' requests, one tenant
        keys_file.write_text("")  # a half-written Secret: the rotated key keeps working
        await asyncio.sleep(0.2)
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(rotated)) as resp:
            assert resp.status == 200


async def test_a_tenants_priority_is_its_requests_default_and_their_most_urgent(
        fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url], TenantConfig(name="a", api_keys=(KEY_A,), priority=5),
                                  TenantConfig(name="b", api_keys=(KEY_B,))))
    sent = [(KEY_A, {}), (KEY_A, {"priority": 0}), (KEY_A, {"priority": -7}),
            (KEY_A, {"priority": 9}), (KEY_B, {"priority": -3}), (KEY_B, {})]
    async with aiohttp.ClientSession() as s:
        for key, extra in sent:
            async with s.post(f"{url}/v1/completions", json={**BODY, **extra},
                              headers=auth(key)) as resp:
                assert resp.status == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        async with s.post(f"{url}/v1/chat/completions", json=chat, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
    # Team a never runs ahead of 5 (it may ask to run later); team b's requests pass as sent.
    assert [body.get("priority") for body in r.requests] == [5, 5, 5, 9, -3, None, 5]
