"""Tenants in front of a real `argosy serve` replica (smollm2-135m, float32, its own
--api-key), called with the official `openai` client: a tenant's key works and is swapped for
the replica key, a wrong key is an AuthenticationError, a tight limit a RateLimitError with
Retry-After, and the tokens charged are the usage the replica reported."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
from argosy_runtime.gateway.config import (
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    TenantConfig,
)
from test_gateway_e2e import MODEL, _missing
from test_gateway_tenants_proxy import metric

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from serve_harness import ServerProcess  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
]

REPLICA_KEY = "sk-replica-only"
KEY_A, KEY_TIGHT = "sk-team-a-e2e", "sk-tight-e2e"


@pytest.fixture(scope="module")
def replica() -> Iterator[ServerProcess]:
    proc = ServerProcess("--api-key", REPLICA_KEY, "--max-model-len", "1024")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


async def tokens_charged(url: str, tenant: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        return {kind: await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant=tenant,
                                   kind=kind) for kind in ("prompt", "completion")}


async def test_tenants_in_front_of_a_real_replica(replica: ServerProcess, gateway) -> None:
    tenants = (TenantConfig(name="team-a", api_keys=(KEY_A,)),
               TenantConfig(name="tight", api_keys=(KEY_TIGHT,), requests_per_minute=1,
                            tokens_per_minute=100_000))
    _, url = await gateway(GatewayConfig(
        models=(ModelRouteConfig(name=MODEL, backends=(replica.url,)),), tenants=tenants,
        replica_api_key=REPLICA_KEY, health=HealthConfig(interval_s=60)))

    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    # The replica takes only its own key: the tenant's key works through the gateway alone.
    direct = httpx.post(f"{replica.url}/v1/chat/completions", json={"model": MODEL},
                        headers={"Authorization": f"Bearer {KEY_A}"})
    assert direct.status_code == 401
    team_a = client(KEY_A)
    # The gateway's own call to the replica's /v1/models carries the replica key.
    assert MODEL in [m.id async for m in team_a.models.list()]

    messages = [{"role": "user", "content": "Say hello."}]
    chat = await team_a.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0)
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    assert await tokens_charged(url, "team-a") == {
        "prompt": chat.usage.prompt_tokens, "completion": chat.usage.completion_tokens}

    stream = await team_a.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True})
    usage = [c.usage async for c in stream if c.usage is not None]
    assert len(usage) == 1
    assert await tokens_charged(url, "team-a") == {
        "prompt": chat.usage.prompt_tokens + usage[0].prompt_tokens,
        "completion": chat.usage.completion_tokens + usage[0].completion_tokens}

    with pytest.raises(openai.AuthenticationError) as auth_error:
        await client("sk-wrong").chat.completions.create(model=MODEL, messages=messages,
                                                         max_tokens=2)
    assert auth_error.value.code == "invalid_api_key"

    tight = client(KEY_TIGHT)
    raw = await tight.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert raw.headers["x-ratelimit-limit-requests"] == "1"
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert raw.headers["x-ratelimit-remaining-tokens"] == "100000"
    assert raw.headers["x-ratelimit-reset-tokens"] == "0s"
    answered = raw.parse()
    assert answered.usage is not None
    with pytest.raises(openai.RateLimitError) as limited:
        await tight.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert limited.value.code == "rate_limit_exceeded"
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
    assert "'tight'" in limited.value.message
    assert await tokens_charged(url, "tight") == {
        "prompt": answered.usage.prompt_tokens, "completion": answered.usage.completion_tokens}


async def test_a_tenant_reaches_only_its_own_stored_responses(replica: ServerProcess,
                                                              gateway) -> None:
    """Stored Responses are the creating tenant's: another tenant's key gets the same 404 as
    an unknown id on every call on it, and cannot continue it; a client-sent X-Argosy-Owner
    changes nothing."""
    tenants = (TenantConfig(name="team-a", api_keys=(KEY_A,)),
               TenantConfig(name="team-b", api_keys=("sk-team-b-e2e",)))
    _, url = await gateway(GatewayConfig(
        models=(ModelRouteConfig(name=MODEL, backends=(replica.url,)),), tenants=tenants,
        replica_api_key=REPLICA_KEY, health=HealthConfig(interval_s=60)))
    team_a = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
    mine = await team_a.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                         temperature=0)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for spoof in ({}, {"X-Argosy-Owner": "team-a"}):
            b = {"Authorization": "Bearer sk-team-b-e2e", **spoof}
            for method, path in (("GET", f"/v1/responses/{mine.id}"),
                                 ("GET", f"/v1/responses/{mine.id}/input_items"),
                                 ("POST", f"/v1/responses/{mine.id}/cancel"),
                                 ("DELETE", f"/v1/responses/{mine.id}")):
                resp = await http.request(method, path, headers=b)
                assert resp.status_code == 404, (method, path, resp.text)
            follow_up = await http.post("/v1/responses", headers=b, json={
                "model": MODEL, "input": "Go on", "max_output_tokens": 2,
                "previous_response_id": mine.id})
            assert follow_up.status_code == 404, follow_up.text
            assert follow_up.json()["error"]["param"] == "previous_response_id"
    # The creator still has it, and may continue it.
    assert (await team_a.responses.retrieve(mine.id)).id == mine.id
    follow_up = await team_a.responses.create(model=MODEL, input="Go on", max_output_tokens=2,
                                              previous_response_id=mine.id, temperature=0)
    assert follow_up.status == "completed" or follow_up.status == "incomplete"
    await team_a.responses.delete(mine.id)
