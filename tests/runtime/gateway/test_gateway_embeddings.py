"""POST /v1/embeddings through the gateway, against small real HTTP replicas: routed by model
(LoRA adapters too) and by prefix affinity on the input, relayed byte for byte, refused for a
cascade route, behind the tenants' keys and limits, held while a model scales from zero."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct

import aiohttp
from argosy_runtime.gateway.config import (
    ActivationConfig,
    CascadeConfig,
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    TenantConfig,
)
from argosy_runtime.gateway.request_text import prompt_chars, prompt_text

KEY = "sk-team-a-secret"


def config(*routes: tuple[str, list[str]], policy: str = "round-robin", **kw) -> GatewayConfig:
    models = tuple(ModelRouteConfig(name=n, backends=tuple(urls), policy=policy)
                   for n, urls in routes)
    kw.setdefault("health", HealthConfig(interval_s=60))  # probes only where a test wants them
    return GatewayConfig(models=models, **kw)


async def embed(s: aiohttp.ClientSession, url: str, body: object,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with s.post(f"{url}/v1/embeddings", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def metric(s: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics (0 when absent), whatever its labels' order."""
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if m and m.group(1) == name and sorted((m.group(2) or "").split(",")) == wanted:
            return float(m.group(3))
    return 0.0


def test_the_prefix_text_of_an_embeddings_request_is_its_input() -> None:
    path = "/v1/embeddings"
    assert prompt_text(path, {"input": "hello there"}) == "hello there"
    # A batch: the first input speaks for it, as the first prompt of a completions batch.
    assert prompt_text(path, {"input": ["first one", "second"]}) == "first one"
    assert prompt_text(path, {"input": [1, 2, 3]}) == "1 2 3"
    assert prompt_text(path, {"input": [[4, 5], [6]]}) == "4 5"
    assert prompt_text(path, {"input": 7}) == prompt_text(path, {}) == ""
    # The token estimate counts every input of a batch, not only the first.
    assert prompt_chars(path, {"input": ["abcd", "ef", [1, 23]]}) == 4 + 2 + 4
    assert prompt_chars(path, {"input": [10, 11]}) == len("10 11")
    # So does every prompt of a completions batch; a chat counts its rendered turns once.
    assert prompt_chars("/v1/completions", {"prompt": ["abcd", "ef", [1, 23]]}) == 4 + 2 + 4
    assert prompt_chars("/v1/completions", {"prompt": [10, 11]}) == len("10 11")
    assert prompt_chars("/v1/completions", {"prompt": "abc"}) == 3


async def test_embeddings_go_to_the_replicas_of_the_model_they_name(fake_replicas,
                                                                   gateway) -> None:
    (tiny,) = await fake_replicas(1, model="tiny")
    (big,) = await fake_replicas(1, model="big")
    tiny.adapters = ["sql"]  # a LoRA adapter on tiny: routed like its parent
    _, url = await gateway(config(("tiny", [tiny.url]), ("big", [big.url])))
    async with aiohttp.ClientSession() as s:
        status, headers, raw = await embed(s, url, {"model": "big", "input": "hello"})
        assert status == 200 and headers["x-argosy-backend"] == big.url
        assert json.loads(raw)["model"] == "big" and not tiny.requests
        status, headers, _ = await embed(s, url, {"model": "sql", "input": "hello"})
        assert status == 200 and headers["x-argosy-backend"] == tiny.url
        assert tiny.requests[-1] == {"model": "sql", "input": "hello"}  # name unchanged
        assert await metric(s, url, "argosy:gateway_requests_total", model="big",
                            backend=big.url, code="200") == 1
        assert await metric(s, url, "argosy:gateway_requests_total", model="tiny",
                            backend=tiny.url, code="200") == 1
        # Several models: `model` is required.
        status, _, raw = await embed(s, url, {"input": "hello"})
        assert status == 400 and json.loads(raw)["error"]["param"] == "model"


async def test_an_unknown_model_is_a_404_and_one_served_model_may_go_unnamed(fake_replicas,
                                                                             gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(("tiny", [r.url])))
    async with aiohttp.ClientSession() as s:
        status, _, raw = await embed(s, url, {"model": "nope", "input": "x"})
        error = json.loads(raw)["error"]
        assert status == 404 and not r.requests
        assert (error["type"], error["code"], error["param"]) == (
            "not_found_error", "model_not_found", "model")
        async with s.post(f"{url}/v1/embeddings", data=b"{not json") as resp:
            assert resp.status == 400 and "error" in await resp.json()
        status, headers, _ = await embed(s, url, {"input": "x"})
        assert status == 200 and headers["x-argosy-backend"] == r.url
        assert r.requests[-1] == {"input": "x"}  # the replica defaults the model itself


async def test_answers_are_relayed_byte_for_byte_floats_and_base64(fake_replicas,
                                                                   gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config(("tiny", [r.url])))
    async with aiohttp.ClientSession() as s:
        answers = {}
        for encoding in ("float", "base64"):
            body = {"model": "tiny", "input": ["a b", [1, 2, 3]], "encoding_format": encoding,
                    "dimensions": 3, "user": "u1"}
            async with s.post(f"{r.url}/v1/embeddings", json=body) as resp:
                direct = await resp.read()
            status, headers, via = await embed(s, url, body)
            assert status == 200 and via == direct
            assert headers["Content-Type"].startswith("application/json")
            assert headers["x-argosy-backend"] == r.url
            assert r.requests[-1] == body  # the request reached the replica unchanged
            answers[encoding] = json.loads(via)
    floats = [item["embedding"] for item in answers["float"]["data"]]
    # base64: little-endian float32 bytes, the same vectors.
    decoded = [list(struct.unpack("<3f", base64.b64decode(item["embedding"])))
               for item in answers["base64"]["data"]]
    assert decoded == floats and len(floats) == 2
    assert answers["float"]["usage"] == {"prompt_tokens": 20, "total_tokens": 20}


async def test_inputs_sharing_a_prefix_go_to_one_replica(fake_replicas, gateway) -> None:
    rs = await fake_replicas(3)
    _, url = await gateway(config(("tiny", [r.url for r in rs]), policy="prefix-affinity"))
    # Longer than one affinity block (64 characters), so the shared part is remembered. Eight:
    # not a multiple of the replicas (a rotation would keep each on one replica too), and
    # enough that the ring puts them all on one replica once in thousands of runs at most.
    prefixes = [f"Document {i} of the product manual, the chapter on safety at work. "
                for i in range(8)]
    seen: dict[str, set[str]] = {p: set() for p in prefixes}
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            for p in prefixes:
                # A string, or a batch whose first input carries the prefix.
                text = p + f"paragraph {i}"
                inputs = text if i % 2 else [text, f"unrelated {i}"]
                status, headers, _ = await embed(s, url, {"model": "tiny", "input": inputs})
                assert status == 200
                seen[p].add(headers["x-argosy-backend"])
    assert all(len(v) == 1 for v in seen.values()), seen
    assert len(set().union(*seen.values())) >= 2  # different prefixes spread out


async def test_a_cascade_route_is_refused(fake_replicas, gateway) -> None:
    """Vectors of two models are not comparable: a cascade cannot answer embeddings."""
    (small,) = await fake_replicas(1, model="tiny")
    (large,) = await fake_replicas(1, model="big")
    cascade = CascadeConfig(name="auto", small="tiny", large="big")
    _, url = await gateway(config(("tiny", [small.url]), ("big", [large.url]),
                                  cascades=(cascade,)))
    async with aiohttp.ClientSession() as s:
        for model in ("auto", "auto:large"):
            status, _, raw = await embed(s, url, {"model": model, "input": "hello"})
            error = json.loads(raw)["error"]
            assert status == 400, model
            assert (error["type"], error["param"]) == ("invalid_request_error", "model")
            assert "cascade" in error["message"] and "'tiny'" in error["message"]
        assert not small.requests and not large.requests
        async with s.post(f"{url}/v1/completions", json={"model": "auto", "prompt": "x"}) as r:
            assert r.status == 200  # the route still answers completions


async def test_tenants_keys_and_limits_apply_and_usage_is_charged(fake_replicas,
                                                                  gateway) -> None:
    (r,) = await fake_replicas(1, prompt_tokens=7)
    # With a priority: embeddings take the tenant's, like generation requests.
    tenant = TenantConfig(name="a", api_keys=(KEY,), requests_per_minute=2,
                          tokens_per_minute=1000, priority=5)
    _, url = await gateway(config(("tiny", [r.url]), tenants=(tenant,),
                                  replica_api_key="replica-secret"))
    body = {"model": "tiny", "input": ["one", "two", "three"]}
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            status, _, raw = await embed(s, url, body, headers)
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert not r.requests  # nothing unauthenticated reached the replica
        for remaining in ("1", "0"):
            status, headers, raw = await embed(s, url, body, auth)
            assert status == 200, raw
            assert headers["x-ratelimit-remaining-requests"] == remaining
        assert r.requests[-1] == {**body, "priority": 5}
        assert r.headers_seen[-1]["Authorization"] == "Bearer replica-secret"
        status, headers, raw = await embed(s, url, body, auth)
        assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
        assert "Retry-After" in headers
        # Charged the answers' usage: 3 inputs x 7 prompt tokens each, no completion tokens.
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == 2 * 21
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="completion") == 0
        assert await metric(s, url, "argosy:gateway_tenant_rate_limited_total", tenant="a",
                            limit="requests") == 1


async def test_a_failed_replica_is_retried_before_the_answer(fake_replicas, gateway) -> None:
    a, b = await fake_replicas(2)
    a.fail_next = 1
    _, url = await gateway(config(("tiny", [a.url, b.url])))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round-robin: one of the two lands on `a` first
            status, _, _ = await embed(s, url, {"model": "tiny", "input": "x"})
            assert status == 200
    # Three upstream requests for two client requests: the failed one was re-sent once.
    assert a.fail_next == 0 and len(a.requests) + len(b.requests) == 3


async def test_a_request_is_held_until_a_replica_of_a_scaled_to_zero_model_comes(
        fake_replicas, gateway) -> None:
    (replica,) = await fake_replicas(1)
    route = ModelRouteConfig(name="tiny", activation=ActivationConfig(timeout_s=30))
    gw, url = await gateway(GatewayConfig(models=(route,), health=HealthConfig(interval_s=60)))
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(embed(s, url, {"model": "tiny", "input": "x"}))
        await asyncio.sleep(0.3)
        assert not held.done() and gw.activators["tiny"].held == 1
        gw.pools["tiny"].add(replica.url)  # what discovery does once the replica is ready
        status, headers, _ = await asyncio.wait_for(held, 5)
    assert status == 200 and headers["x-argosy-backend"] == replica.url
