"""Review fixes of the routing policies: each test fails without its fix."""

from __future__ import annotations

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies import RouteRequest, make_policy
from argosy_runtime.gateway.policies.bounded_load import capacity, within_bound


def replicas(n: int) -> list[Replica]:
    return [Replica(url=f"http://10.0.0.{i}:8000") for i in range(n)]


def test_adapter_with_every_replica_over_the_kv_watermark_may_stay_on_its_holder() -> None:
    """No replica within the bound (all KV-full): the request goes to the inner policy over
    all candidates, as the docstring says, not only to the replicas that would have to load
    the adapter (evicting another one, on a replica no less full)."""
    policy = make_policy("least-load")
    holder, other = replicas(2)
    for r in (holder, other):
        r.adapters = frozenset({"sql", "chat"})
        r.kv_cache_usage = 0.99
    holder.loaded_adapters = frozenset({"sql"})
    other.loaded_adapters = frozenset({"chat"})
    other.in_flight = 3  # the holder is also the less loaded one
    chosen = policy.choose([holder, other], RouteRequest(prefix="x" * 64, adapter="sql"))
    assert chosen is holder


def test_bound_is_exact_where_the_float_product_is_not() -> None:
    """ceil(1.1 * 50 / 5) is 11, but 1.1 * 50 / 5 is 11.000000000000002 in floats, whose
    ceil let a replica take a 12th request past the bound."""
    routing = RoutingConfig(load_factor=1.1, min_capacity=1)
    rs = replicas(5)
    for r, n in zip(rs, (11, 10, 10, 9, 9), strict=True):
        r.in_flight = n  # 49 in flight, 50 with the request being placed
    assert capacity(rs, routing) == 11
    assert not within_bound(rs[0], capacity(rs, routing), routing)


def test_a_prefix_learned_under_an_adapter_does_not_steer_the_base_model() -> None:
    """A replica caches an adapter's K/V apart from the base model's (the adapter salts its
    prefix-cache hashes, request.py `cache_salt`): where an adapter's request with a prompt
    went says nothing of where the base model's prompt is cached."""
    from argosy_runtime.gateway.policies import PrefixAffinityPolicy

    prompt = "You are a helpful assistant. " * 20
    rs = replicas(4)
    base_home = PrefixAffinityPolicy().choose(rs, RouteRequest(prefix=prompt))
    policy = PrefixAffinityPolicy()
    elsewhere = next(r for r in rs if r is not base_home)
    # Adapter affinity narrowed the adapter's request to the replica holding the adapter.
    assert policy.choose([elsewhere], RouteRequest(prefix=prompt, adapter="sql")) is elsewhere
    assert policy.choose(rs, RouteRequest(prefix=prompt)) is base_home
    # The adapter's own prompts still follow what they taught the table.
    assert policy.choose(rs, RouteRequest(prefix=prompt, adapter="sql")) is elsewhere


def test_a_prefix_learned_under_a_cache_salt_steers_only_that_salt() -> None:
    """vLLM's `cache_salt`: a replica shares cached blocks only between requests with the
    same salt, so a salted request's prompt must not place unsalted (or other salts')
    requests, and the same salt keeps following its own prompt."""
    from argosy_runtime.gateway.policies import PrefixAffinityPolicy

    prompt = "You are a helpful assistant. " * 20
    rs = replicas(4)
    base_home = PrefixAffinityPolicy().choose(rs, RouteRequest(prefix=prompt))
    policy = PrefixAffinityPolicy()
    elsewhere = next(r for r in rs if r is not base_home)
    salted = RouteRequest(prefix=prompt, cache_salt="user-1")
    assert policy.choose([elsewhere], salted) is elsewhere  # the others were busy
    assert policy.choose(rs, RouteRequest(prefix=prompt)) is base_home
    assert policy.choose(rs, salted) is elsewhere
    # an adapter with the salt is a partition of its own, apart from the adapter's unsalted
    assert policy.choose([elsewhere], RouteRequest(prefix=prompt, adapter="sql")) is elsewhere
    both = RouteRequest(prefix=prompt, adapter="sql", cache_salt="user-1")
    assert policy.choose(rs, both) is PrefixAffinityPolicy().choose(rs, both)


async def test_the_gateway_routes_a_cache_salt_apart(fake_replicas, gateway) -> None:
    """Through the gateway: salted requests sent first change nothing of where unsalted
    requests with the same documents land, as for another tenant's."""
    import aiohttp
    from argosy_runtime.gateway.config import GatewayConfig, HealthConfig, ModelRouteConfig

    replicas = await fake_replicas(4)
    config = GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=tuple(r.url for r in replicas),
                                 policy="prefix-affinity"),),
        health=HealthConfig(interval_s=60))
    documents = [f"Document {i}: the confidential figures of quarter {i} are as follows. " * 2
                 for i in range(8)]

    async def where_unsalted_lands(salted_first: bool) -> list[str]:
        _, url = await gateway(config)  # a new gateway: nothing routed yet
        landed = []
        async with aiohttp.ClientSession() as s:
            for document in documents:
                for prompt, extra in ([(document + "Summarize.", {"cache_salt": "u1"})]
                                      if salted_first else []) + [(document + "Risks?", {})]:
                    async with s.post(f"{url}/v1/completions", json={
                            "model": "tiny", "prompt": prompt, **extra}) as resp:
                        assert resp.status == 200
                        backend = resp.headers["x-argosy-backend"]
                landed.append(backend)
        return landed

    assert await where_unsalted_lands(True) == await where_unsalted_lands(False)


def test_a_prompt_cache_key_spreads_a_shared_prefix_and_keeps_each_key_together() -> None:
    """OpenAI's `prompt_cache_key`: many users send one long system prompt. Unkeyed, they all
    follow it to the replica that cached it first; keyed, each key is placed on its own (so
    the load spreads) and a key's later requests, the grown conversation and a short prompt
    alike, go where its first one went."""
    from argosy_runtime.gateway.policies import PrefixAffinityPolicy

    system = "You are a helpful assistant who answers in detail. " * 10
    rs = replicas(4)
    policy = PrefixAffinityPolicy()
    unkeyed = {policy.choose(rs, RouteRequest(prefix=system + f"user {i} asks")).url
               for i in range(16)}
    assert len(unkeyed) == 1
    homes = {f"user-{i}": policy.choose(rs, RouteRequest(prefix=system + f"user {i} asks",
                                                         cache_key=f"user-{i}"))
             for i in range(16)}
    assert len({r.url for r in homes.values()}) >= 3
    rs[0].in_flight = rs[1].in_flight = 1  # a short prompt's least-load would move it
    for key, home in homes.items():
        grown = RouteRequest(prefix=system + "a long conversation " * 20, cache_key=key)
        assert policy.choose(rs, grown) is home
        assert policy.choose(rs, RouteRequest(prefix="hi", cache_key=key)) is home


async def prefix_affinity_gateway(fake_replicas, gateway) -> str:  # noqa: ANN001
    """A gateway's URL in front of four fake replicas under prefix affinity."""
    from argosy_runtime.gateway.config import GatewayConfig, HealthConfig, ModelRouteConfig

    backends = await fake_replicas(4)
    config = GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=tuple(r.url for r in backends),
                                 policy="prefix-affinity"),),
        health=HealthConfig(interval_s=60))
    _, url = await gateway(config)
    return url


async def where_chats_land(url: str, questions: list[str], extra: dict) -> set[str]:
    """The replicas that answered one chat request per question, sent one after another."""
    import aiohttp

    seen = set()
    async with aiohttp.ClientSession() as s:
        for question in questions:
            async with s.post(f"{url}/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": question}],
                    **extra}) as resp:
                assert resp.status == 200
                seen.add(resp.headers["x-argosy-backend"])
    return seen


async def test_the_gateway_places_chat_requests_by_their_prompt_cache_key(
        fake_replicas, gateway) -> None:
    """Through the gateway: a chat request's `prompt_cache_key` reaches the policy, so one
    key's short messages (which least-load would scatter) land together."""
    url = await prefix_affinity_gateway(fake_replicas, gateway)
    short = [f"hi {i}" for i in range(8)]
    assert len(await where_chats_land(url, short, {"prompt_cache_key": "conversation-7"})) == 1
    assert len(await where_chats_land(url, short, {})) > 1  # without it, least-load spreads them


async def test_the_gateway_places_chat_requests_by_their_tools(fake_replicas, gateway) -> None:
    """Agents sending one tool list with different questions share the rendered tools in the
    replica's prefix cache: they land together (the questions alone hash apart)."""
    url = await prefix_affinity_gateway(fake_replicas, gateway)
    tools = [{"type": "function", "function": {
        "name": f"tool_{n}", "description": "Looks something up in the company's records.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
        for n in range(4)]
    questions = [f"Question {i}: what did the team decide about the launch date?"
                 for i in range(8)]
    assert len(await where_chats_land(url, questions, {"tools": tools})) == 1
    # the questions alone hash to several replicas
    assert len(await where_chats_land(url, questions, {})) > 1
