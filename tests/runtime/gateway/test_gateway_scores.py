"""POST /v1/score, /v1/rerank and /v1/classify (and vLLM's /score, /rerank, /classify,
Cohere's /v2/rerank) through the gateway, against small real HTTP replicas: routed by model and by the query's prefix like
/v1/embeddings, relayed byte for byte, refused for a cascade route, behind the tenants' keys
and limits with their prompt tokens charged."""

from __future__ import annotations

import json

import aiohttp
from argosy_runtime.gateway.config import CascadeConfig, TenantConfig
from argosy_runtime.gateway.request_text import prompt_chars, prompt_text
from test_gateway_embeddings import KEY, config, metric

SCORE = {"text_1": "what is argosy", "text_2": ["a server", "a ship"]}
RERANK = {"query": "what is argosy", "documents": ["a server", "a ship", "a fleet"]}
CLASSIFY = {"input": ["is argosy a ship?", "it serves models"]}
PATHS = [("/v1/score", SCORE), ("/score", SCORE), ("/v1/rerank", RERANK),
         ("/rerank", RERANK), ("/v2/rerank", RERANK), ("/v1/classify", CLASSIFY),
         ("/classify", CLASSIFY)]


async def post(s: aiohttp.ClientSession, url: str, body: object,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with s.post(url, json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def test_the_prefix_text_is_the_query_and_every_text_is_counted() -> None:
    assert prompt_text("/v1/score", {"text_1": "q", "text_2": ["a", "b"]}) == "q"
    assert prompt_text("/score", {"text_1": ["q1", "q2"], "text_2": ["a", "b"]}) == "q1"
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        assert prompt_text(path, {"query": "q", "documents": ["a"]}) == "q"
        assert prompt_chars(path, {"query": "abc", "documents": ["de", "f", 7]}) == 6
    assert prompt_chars("/v1/score", {"text_1": "abc", "text_2": ["de", "f"]}) == 6
    assert prompt_chars("/v1/score", {"text_1": 5}) == 0
    assert prompt_text("/v1/rerank", {}) == prompt_text("/v1/score", {"text_1": 5}) == ""
    # classify's `input` reads like an embeddings input; every input of a batch is counted.
    for path in ("/v1/classify", "/classify"):
        assert prompt_text(path, {"input": ["q1", "q2"]}) == "q1"
        assert prompt_text(path, {"input": [5, 6]}) == "5 6"
        assert prompt_chars(path, {"input": ["abc", "de"]}) == 5


async def test_each_path_goes_to_the_model_it_names_byte_for_byte(fake_replicas,
                                                                  gateway) -> None:
    (tiny,) = await fake_replicas(1, model="tiny")
    (big,) = await fake_replicas(1, model="big")
    _, url = await gateway(config(("tiny", [tiny.url]), ("big", [big.url])))
    async with aiohttp.ClientSession() as s:
        for path, body in PATHS:
            body = {"model": "big", **body, "priority": 3}
            direct = await post(s, big.url + path, body)
            status, headers, raw = await post(s, url + path, body)
            assert status == 200 and headers["x-argosy-backend"] == big.url, (path, raw)
            assert raw == direct[2] and big.requests[-1] == body  # unchanged both ways
        assert not tiny.requests
        # Several models: `model` is required; an unknown one is a 404.
        status, _, raw = await post(s, url + "/v1/rerank", RERANK)
        assert status == 400 and json.loads(raw)["error"]["param"] == "model"
        status, _, raw = await post(s, url + "/v1/score", {"model": "nope", **SCORE})
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


async def test_one_query_goes_to_one_replica(fake_replicas, gateway) -> None:
    rs = await fake_replicas(3)
    _, url = await gateway(config(("tiny", [r.url for r in rs]), policy="prefix-affinity"))
    # Longer than one affinity block (64 characters), so the query is remembered.
    queries = [f"Question {i}: which chapter of the product manual covers safety at work? "
               for i in range(8)]
    seen: dict[str, set[str]] = {q: set() for q in queries}
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            for q in queries:
                path, body = [("/v1/score", {"text_1": q, "text_2": [f"doc {i}"]}),
                              ("/v1/rerank", {"query": q, "documents": [f"doc {i}"]}),
                              ("/v1/classify", {"input": [q, f"doc {i}"]})][i % 3]
                status, headers, _ = await post(s, url + path, {"model": "tiny", **body})
                assert status == 200
                seen[q].add(headers["x-argosy-backend"])
    assert all(len(v) == 1 for v in seen.values()), seen
    assert len(set().union(*seen.values())) >= 2


async def test_a_cascade_route_is_refused(fake_replicas, gateway) -> None:
    (small,) = await fake_replicas(1, model="tiny")
    (large,) = await fake_replicas(1, model="big")
    cascade = CascadeConfig(name="auto", small="tiny", large="big")
    _, url = await gateway(config(("tiny", [small.url]), ("big", [large.url]),
                                  cascades=(cascade,)))
    async with aiohttp.ClientSession() as s:
        for path, body in PATHS:
            status, _, raw = await post(s, url + path, {"model": "auto", **body})
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == "model", path
            assert "cascade" in error["message"] and "'tiny'" in error["message"]
    assert not small.requests and not large.requests


async def test_tenants_keys_limits_priority_and_prompt_tokens_apply(fake_replicas,
                                                                   gateway) -> None:
    (r,) = await fake_replicas(1, prompt_tokens=7)
    tenant = TenantConfig(name="a", api_keys=(KEY,), requests_per_minute=len(PATHS),
                          tokens_per_minute=10_000, priority=5)
    _, url = await gateway(config(("tiny", [r.url]), tenants=(tenant,),
                                  replica_api_key="replica-secret"))
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:
        for path, body in PATHS:  # outside /v1/ too: no key, no answer
            status, _, raw = await post(s, url + path, body)
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert not r.requests
        for path, body in PATHS:
            status, headers, raw = await post(s, url + path, body, auth)
            assert status == 200, (path, raw)
            assert r.requests[-1] == {**body, "priority": 5}  # the tenant's priority
            assert r.headers_seen[-1]["Authorization"] == "Bearer replica-secret"
        status, _, raw = await post(s, url + "/v2/rerank", RERANK, auth)
        assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
        # Charged each answer's prompt tokens: 7 per text (score 1 + 2, rerank 1 + 3,
        # classify 2).
        charged = 2 * 7 * 3 + 3 * 7 * 4 + 2 * 7 * 2
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="prompt") == charged
        assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                            kind="completion") == 0
