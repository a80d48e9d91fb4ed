"""A cascade through the gateway as clients use it: the official `openai` client in front of
fake replicas of a small and a large model."""

from __future__ import annotations

import openai
from argosy_runtime.gateway.config import (
    CascadeConfig,
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
)


def cascade_config(small_url: str, large_url: str, **cascade: object) -> GatewayConfig:
    return GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=(small_url,)),
                ModelRouteConfig(name="big", backends=(large_url,))),
        cascades=(CascadeConfig(name="auto", small="tiny", large="big", **cascade),),
        health=HealthConfig(interval_s=60))


async def test_a_client_that_asks_for_the_small_model_gets_its_answer(fake_replicas,
                                                                      gateway) -> None:
    """`auto:small` and `x-argosy-cascade: small` force the small model: an unsure answer of
    it is still the answer, never escalated to (and paid for on) the large model."""
    (small,) = await fake_replicas(1, model="tiny", logprob=-3.0)
    (large,) = await fake_replicas(1, model="big")
    _, url = await gateway(cascade_config(small.url, large.url, min_mean_logprob=-1.0))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    forced = [
        ("model_name", {"model": "auto:small"}),
        ("header", {"model": "auto", "extra_headers": {"x-argosy-cascade": "small"}}),
    ]
    for reason, how in forced:
        raw = await client.completions.with_raw_response.create(prompt="hi", **how)
        answer = raw.parse()
        assert (raw.headers["x-argosy-cascade"], raw.headers["x-argosy-cascade-reason"],
                answer.model) == ("small", reason, "tiny"), reason
        assert answer.choices[0].text == "".join(small.text_of(i) for i in range(4))
        # Nothing was asked on the client's behalf: the request went as sent.
        assert "logprobs" not in small.requests[-1]
    assert large.requests == []
    # The rules' own choice is still checked: the same unsure answer goes to the large model.
    raw = await client.completions.with_raw_response.create(model="auto", prompt="hi")
    assert (raw.headers["x-argosy-cascade"], raw.headers["x-argosy-cascade-reason"],
            raw.parse().model) == ("large", "low_confidence", "big")


async def test_a_keyword_matches_what_the_messages_say_not_their_roles(fake_replicas,
                                                                      gateway) -> None:
    (small,) = await fake_replicas(1, model="tiny")
    (large,) = await fake_replicas(1, model="big")
    _, url = await gateway(cascade_config(small.url, large.url, keywords=("system", "tool")))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    easy = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2+2?"}]
    raw = await client.chat.completions.with_raw_response.create(model="auto", messages=easy)
    assert (raw.headers["x-argosy-cascade"], raw.parse().model) == ("small", "tiny")
    hard = [{"role": "user", "content": "Design a distributed SYSTEM for payments."}]
    raw = await client.chat.completions.with_raw_response.create(model="auto", messages=hard)
    assert (raw.headers["x-argosy-cascade"], raw.headers["x-argosy-cascade-reason"],
            raw.parse().model) == ("large", "keyword", "big")
