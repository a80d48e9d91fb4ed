"""Tenants and prefix-affinity routing: one tenant's prompts never decide where another
tenant's requests go, as replicas never let one tenant's cached prompts serve another's
(server.md, "Prefix cache per owner"): the replica a request lands on, which every answer
names in `x-argosy-backend`, must not tell a tenant what another one sent."""

from __future__ import annotations

import aiohttp
from argosy_runtime.gateway.config import (
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    TenantConfig,
)

KEY_A, KEY_B = "sk-routing-a", "sk-routing-b"
# Longer than one 64-character routing block, shorter than the 256 characters the hash ring
# reads: a document plus a question is a different ring key from the document alone.
DOCUMENTS = [f"Document {i}: the confidential figures of quarter {i} are as follows. " * 2
             for i in range(8)]


async def test_one_tenants_prompts_never_place_another_tenants_requests(fake_replicas,
                                                                        gateway) -> None:
    replicas = await fake_replicas(4)
    config = GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=tuple(r.url for r in replicas),
                                 policy="prefix-affinity"),),
        tenants=(TenantConfig(name="a", api_keys=(KEY_A,)),
                 TenantConfig(name="b", api_keys=(KEY_B,))),
        health=HealthConfig(interval_s=60))

    async def backend(s: aiohttp.ClientSession, url: str, key: str, prompt: str) -> str:
        async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt},
                          headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200
            return resp.headers["x-argosy-backend"]

    async def where_b_lands(a_sent_the_documents: bool) -> list[str]:
        _, url = await gateway(config)  # a new gateway: nothing routed yet
        landed = []
        async with aiohttp.ClientSession() as s:
            for document in DOCUMENTS:
                if a_sent_the_documents:
                    a_first = await backend(s, url, KEY_A, document + "Summarize.")
                    # Within a tenant, affinity holds: a follow-up on the same document goes
                    # where its prefix is cached.
                    assert await backend(s, url, KEY_A, document + "Tabulate.") == a_first
                landed.append(await backend(s, url, KEY_B, document + "Any risks?"))
        return landed

    assert await where_b_lands(True) == await where_b_lands(False)
