"""Routing policies: distribution, bounded-load spill, consistent mapping, fallbacks."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import GatewayConfig, RoutingConfig
from argosy_runtime.gateway.policies import (
    LeastLoadPolicy,
    Policy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    RouteRequest,
    make_policy,
)
from argosy_runtime.gateway.policies.adapter_affinity import RECENT_S, AdapterAffinityPolicy
from argosy_runtime.gateway.policies.bounded_load import capacity
from argosy_runtime.gateway.policies.hashing import rendezvous_order
from argosy_runtime.gateway.policies.prefix_affinity import HashRing


def replicas(n: int, start: int = 0) -> list[Replica]:
    return [Replica(url=f"http://10.0.0.{i}:8000") for i in range(start, start + n)]


def keys(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"system prompt {rng.getrandbits(64):x} " * 3 for _ in range(n)]


def test_round_robin_cycles_evenly() -> None:
    policy, rs = RoundRobinPolicy(), replicas(3)
    picks = Counter(policy.choose(rs, RouteRequest()).url for _ in range(300))
    assert sorted(picks.values()) == [100, 100, 100]
    # Consecutive picks never repeat a replica while three are available.
    seq = [policy.choose(rs, RouteRequest()).url for _ in range(6)]
    assert all(a != b for a, b in zip(seq, seq[1:], strict=False))


def test_round_robin_empty() -> None:
    assert RoundRobinPolicy().choose([], RouteRequest()) is None


def test_least_load_prefers_lowest_score_from_all_signals() -> None:
    policy = LeastLoadPolicy(RoutingConfig(w_in_flight=1.0, w_waiting=1.0, w_kv=2.0))
    a, b, c = replicas(3)
    a.in_flight, b.num_waiting, c.kv_cache_usage = 2, 3, 0.9
    # scores: a=2, b=3, c=1.8
    assert policy.choose([a, b, c], RouteRequest()) is c
    c.kv_cache_usage = 1.0  # c=2.0 ties a -> both get picked, b never
    picks = Counter(policy.choose([a, b, c], RouteRequest()).url for _ in range(10))
    assert set(picks) == {a.url, c.url} and picks[a.url] == picks[c.url] == 5


def test_prefix_affinity_same_prefix_same_replica() -> None:
    policy, rs = PrefixAffinityPolicy(RoutingConfig()), replicas(4)
    for key in keys(50):
        first = policy.choose(rs, RouteRequest(prefix=key))
        assert all(policy.choose(rs, RouteRequest(prefix=key)) is first for _ in range(5))


def test_prefix_affinity_spreads_distinct_prefixes() -> None:
    policy, rs = PrefixAffinityPolicy(RoutingConfig()), replicas(4)
    picks = Counter(policy.choose(rs, RouteRequest(prefix=k)).url for k in keys(4000))
    assert set(picks) == {r.url for r in rs}
    # 160 virtual nodes each: every replica within 25% of an even share.
    for count in picks.values():
        assert abs(count - 1000) < 250, picks


def test_prefix_affinity_bounded_load_spills_and_never_exceeds_cap() -> None:
    routing = RoutingConfig(load_factor=1.25, min_capacity=1)
    policy, rs = PrefixAffinityPolicy(routing), replicas(4)
    hot = "the same long system prompt " * 4
    owner = policy.choose(rs, RouteRequest(prefix=hot))
    placed = []
    for _ in range(40):  # 40 concurrent requests for one prefix, none finishing
        cap = policy.capacity(rs)
        r = policy.choose(rs, RouteRequest(prefix=hot))
        assert r.in_flight < cap
        r.in_flight += 1
        placed.append(r.url)
    loads = {r.url: r.in_flight for r in rs}
    # The owner got the first ones, then the excess spilled; no replica above the final bound.
    assert placed[0] == owner.url
    assert max(loads.values()) <= math.ceil(1.25 * 40 / 4)
    assert len([v for v in loads.values() if v > 0]) >= 2
    # Spill follows the ring order of the key: the second replica used is the next clockwise.
    order = policy.ring([r.url for r in rs]).walk(hot[: routing.prefix_chars])
    assert [u for u in dict.fromkeys(placed)] == order[: len(set(placed))]


def test_prefix_affinity_min_capacity_keeps_a_prefix_together_at_low_load() -> None:
    policy, rs = PrefixAffinityPolicy(RoutingConfig(min_capacity=4)), replicas(4)
    hot = "the same long system prompt " * 4
    placed = []
    for _ in range(6):
        r = policy.choose(rs, RouteRequest(prefix=hot))
        r.in_flight += 1
        placed.append(r.url)
    # ceil(1.25 * 5 / 4) = 2 would spill the third; the floor of 4 keeps four together.
    assert len(set(placed[:4])) == 1 and placed[4] != placed[0]


def test_prefix_affinity_mapping_is_consistent_across_backend_changes() -> None:
    four, five = replicas(4), replicas(5)
    ks = keys(3000, seed=1)
    # One policy per membership, each key asked once: every prefix is cold, the ring decides.
    p4, p5, p3 = PrefixAffinityPolicy(), PrefixAffinityPolicy(), PrefixAffinityPolicy()
    before = {k: p4.choose(four, RouteRequest(prefix=k)).url for k in ks}
    after = {k: p5.choose(five, RouteRequest(prefix=k)).url for k in ks}
    moved = [k for k in ks if before[k] != after[k]]
    # Only keys taken over by the new replica move (about 1/5 of them), none between old ones.
    assert all(after[k] == five[4].url for k in moved)
    assert 0.1 < len(moved) / len(ks) < 0.3
    # Removing a replica moves only the keys it owned.
    three = [r for r in four if r.url != four[1].url]
    removed = {k: p3.choose(three, RouteRequest(prefix=k)).url for k in ks}
    assert all(removed[k] == before[k] for k in ks if before[k] != four[1].url)


def test_prefix_affinity_known_prefix_stays_where_it_is_cached() -> None:
    policy = PrefixAffinityPolicy(RoutingConfig(block_chars=32))
    four, five = replicas(4), replicas(5)
    ks = keys(500, seed=2)
    before = {k: policy.choose(four, RouteRequest(prefix=k)).url for k in ks}
    # A new replica joins: prefixes already served keep their replica (their KV is there).
    assert all(policy.choose(five, RouteRequest(prefix=k)).url == before[k] for k in ks)


def test_prefix_affinity_follows_shared_prefixes_shorter_than_the_ring_key() -> None:
    # The ring key is 256 characters, the shared part only 80: the affinity table still keeps
    # every prompt of one group on the replica the group's first prompt went to.
    policy, rs = PrefixAffinityPolicy(RoutingConfig(block_chars=32, prefix_chars=256)), replicas(4)
    groups = [f"group {g:02d} " + "shared context " * 5 for g in range(12)]
    where: dict[int, set[str]] = {g: set() for g in range(len(groups))}
    for q in range(6):
        for g, shared in enumerate(groups):
            prompt = shared[:80] + f" user question number {q} " * 10
            where[g].add(policy.choose(rs, RouteRequest(prefix=prompt)).url)
    assert all(len(v) == 1 for v in where.values())
    assert len(set().union(*where.values())) >= 3  # groups spread over the replicas


def test_block_hashes_are_prefix_digests() -> None:
    from argosy_runtime.gateway.policies.prefix_affinity import block_hashes

    a = block_hashes("x" * 100 + "abc", 32)
    b = block_hashes("x" * 100 + "abd", 32)
    assert len(a) == 3 and a == b  # the differing tail is past the last whole block
    c = block_hashes("y" + "x" * 99, 32)
    assert all(p != q for p, q in zip(a, c, strict=True))


def test_prefix_affinity_short_prompt_falls_back_to_least_load() -> None:
    policy = make_policy("prefix-affinity", RoutingConfig(min_prefix_chars=16))
    a, b = replicas(2)
    a.in_flight = 3
    assert policy.choose([a, b], RouteRequest(prefix="hi")) is b
    b.in_flight = 5
    assert policy.choose([a, b], RouteRequest(prefix="hi")) is a


def test_prefix_affinity_skips_replica_over_kv_watermark() -> None:
    policy = PrefixAffinityPolicy(RoutingConfig(kv_high_watermark=0.9))
    rs = replicas(3)
    key = "a shared prefix that is long enough"
    owner = policy.choose(rs, RouteRequest(prefix=key))
    owner.kv_cache_usage = 0.95
    second = policy.choose(rs, RouteRequest(prefix=key))
    assert second is not owner
    assert second.url == policy.ring([r.url for r in rs]).walk(key)[1]


def test_hash_ring_walk_lists_each_member_once() -> None:
    ring = HashRing(["a", "b", "c"], virtual_nodes=50)
    for k in keys(20):
        assert sorted(ring.walk(k)) == ["a", "b", "c"]
    assert HashRing([], 10).walk("x") == []


def test_make_policy_rejects_unknown() -> None:
    import pytest

    with pytest.raises(ValueError, match="policy"):
        make_policy("random")


POLICIES = ["round-robin", "least-load", "prefix-affinity"]


def with_adapter(rs: list[Replica], loaded: set[int], name: str = "sql") -> list[Replica]:
    """Every replica serves `name`; those at the indexes in `loaded` have it in memory (the
    others registered only: --max-loaded-loras loads it on first use). The proxy has already
    dropped replicas that do not serve it (upstream.send)."""
    for i, r in enumerate(rs):
        r.adapters = frozenset({name, "other"})
        r.loaded_adapters = frozenset({name} if i in loaded else {"other"})
    return rs


@pytest.mark.parametrize("name", POLICIES)
def test_adapter_requests_go_to_replicas_with_the_adapter_loaded(name: str) -> None:
    policy = make_policy(name)
    rs = with_adapter(replicas(3), loaded={1})
    for i, prompt in enumerate(keys(12)):  # distinct prefixes: the ring alone would spread them
        rs[0].in_flight = rs[2].in_flight = 0
        rs[1].in_flight = i % 3  # under min_capacity: still preferred
        assert policy.choose(rs, RouteRequest(prefix=prompt, adapter="sql")) is rs[1]
    # Loaded on two: both share the adapter's requests, the registered-only one gets none.
    # (A new policy: this one sent "sql" to the replica at rs[1]'s URL, which now holds it.)
    policy, rs = make_policy(name), with_adapter(replicas(3), loaded={0, 2})
    picks = Counter(
        policy.choose(rs, RouteRequest(prefix=prompt, adapter="sql")).url for prompt in keys(40)
    )
    assert picks[rs[1].url] == 0 < min(picks[rs[0].url], picks[rs[2].url])


@pytest.mark.parametrize("name", POLICIES)
def test_adapter_affinity_gives_way_when_the_loaded_replica_is_far_busier(name: str) -> None:
    """The bound prefix affinity uses: ceil(load_factor * (in-flight + 1) / replicas), never
    below min_capacity, and the KV high-watermark."""
    loaded, registered = with_adapter(replicas(2), loaded={0})
    request = RouteRequest(prefix="a prompt long enough to have a prefix", adapter="sql")

    def choose() -> Replica:
        # A new policy each time: one that sent "sql" to `registered` counts it as a holder.
        policy = make_policy(name, RoutingConfig(min_capacity=4, load_factor=1.25))
        return policy.choose([loaded, registered], request)

    loaded.in_flight = 3  # cap = max(4, ceil(1.25 * 4 / 2)) = 4: room for one more
    assert choose() is loaded
    loaded.in_flight = 4  # at its bound while the other is idle: the load is worth paying
    assert choose() is registered
    # The bound grows with the total: busy everywhere, the loaded one keeps up to 25% more.
    loaded.in_flight, registered.in_flight = 12, 10  # cap = ceil(1.25 * 23 / 2) = 15
    assert choose() is loaded
    loaded.in_flight = 18  # cap = ceil(1.25 * 29 / 2) = 19: still within
    assert choose() is loaded
    loaded.in_flight = 30  # cap = ceil(1.25 * 41 / 2) = 26: over
    assert choose() is registered
    loaded.in_flight = registered.in_flight = 0
    loaded.kv_cache_usage = 0.96  # KV nearly full: a load elsewhere beats queueing here
    assert choose() is registered


def test_adapter_affinity_leaves_other_requests_to_the_policy() -> None:
    policy = make_policy("round-robin")
    rs = with_adapter(replicas(2), loaded={0, 1})
    # The base model, and an adapter every replica has loaded: rotation.
    for request in (RouteRequest(prefix="x"), RouteRequest(prefix="x", adapter="sql")):
        seq = [policy.choose(rs, request) for _ in range(4)]
        assert seq[0] is not seq[1] and seq[:2] == seq[2:]
    assert make_policy("least-load").name == "least-load"


def adapter_names(n: int) -> list[str]:
    return [f"tenant-{i}-sql" for i in range(n)]


def serving(rs: list[Replica], names: list[str], loaded: frozenset[str] = frozenset()
            ) -> list[Replica]:
    """Every replica serves every adapter in `names`, with only `loaded` in memory."""
    for r in rs:
        r.adapters, r.loaded_adapters = frozenset(names), loaded
    return rs


@pytest.mark.parametrize("name", POLICIES)
def test_an_adapter_loaded_nowhere_goes_to_one_replica(name: str) -> None:
    """Left to the policy, its requests would spread and every replica would load it."""
    policy = make_policy(name)
    rs = serving(replicas(4), adapter_names(8))
    for adapter in adapter_names(8):
        picks = {policy.choose(rs, RouteRequest(prefix=p, adapter=adapter)).url for p in keys(12)}
        assert len(picks) == 1, (adapter, picks)
    # A replica whose metrics list no adapters (an older server) is never "loaded": the same.
    bare = replicas(4)
    picks = {policy.choose(bare, RouteRequest(prefix=p, adapter="sql")).url for p in keys(8)}
    assert len(picks) == 1


@pytest.mark.parametrize("name", POLICIES)
def test_past_the_loaded_replicas_bound_one_registered_replica_loads_it(name: str) -> None:
    policy = make_policy(name, RoutingConfig(min_capacity=4))
    rs = with_adapter(replicas(4), loaded={0})
    rs[0].in_flight = 4  # at its bound: another replica must load the adapter
    picks = {policy.choose(rs, RouteRequest(prefix=p, adapter="sql")).url for p in keys(12)}
    assert len(picks) == 1 and rs[0].url not in picks


def homes(policy: Policy, rs: list[Replica], names: list[str]) -> dict[str, str]:
    return {a: policy.choose(rs, RouteRequest(prefix="p" * 40, adapter=a)).url for a in names}


def test_adapters_loaded_nowhere_spread_over_the_replicas() -> None:
    policy, rs = make_policy("least-load"), replicas(4)
    assert len(set(homes(policy, serving(rs, adapter_names(8)), adapter_names(8)).values())) > 1
    # Many adapters: an even share each (the next one goes where the fewest are).
    spread = Counter(homes(policy, serving(rs, adapter_names(400)), adapter_names(400)).values())
    assert set(spread) == {r.url for r in rs} and set(spread.values()) == {100}


def test_removing_a_replica_moves_only_its_adapters() -> None:
    policy, names = make_policy("prefix-affinity"), adapter_names(60)
    rs = serving(replicas(4), names)
    before = homes(policy, rs, names)
    gone = rs.pop(2)
    after = homes(policy, rs, names)
    moved = {a for a in names if before[a] != after[a]}
    assert moved == {a for a in names if before[a] == gone.url} != set()
    # Its 15 go to the other three by how many adapters each holds (15 each): 5 to each.
    assert sorted(Counter(after.values()).values()) == [20, 20, 20]


@pytest.mark.parametrize("name", POLICIES)
def test_an_unloaded_adapter_spills_past_its_replicas_bound(name: str) -> None:
    """Requests that do not finish: the adapter's replica takes them up to the bound (never
    below min_capacity), then the next replica in the adapter's order, and so on."""
    routing = RoutingConfig(min_capacity=2, load_factor=1.25)
    policy, rs = make_policy(name, routing), serving(replicas(4), ["sql"])
    picks: list[Replica] = []
    for prompt in keys(16):
        cap = capacity(rs, routing)
        r = policy.choose(rs, RouteRequest(prefix=prompt, adapter="sql"))
        assert r.in_flight < cap
        r.in_flight += 1
        picks.append(r)
    home, second = picks[0], picks[2]
    assert picks[:4] == [home, home, second, second] and second is not home
    # As the bound grows with the total, the adapter's replica is filled first again.
    assert home.in_flight == max(r.in_flight for r in rs) and all(r.in_flight for r in rs)


def test_adapter_affinity_can_be_turned_off() -> None:
    policy = make_policy("round-robin", RoutingConfig(adapter_affinity=False))
    rs = with_adapter(replicas(2), loaded={0})
    seq = [policy.choose(rs, RouteRequest(adapter="sql")) for _ in range(4)]
    assert seq == rs + rs  # rotation, as for a base-model request
    config = GatewayConfig.from_dict(
        {"routing": {"adapter_affinity": False}, "models": [{"name": "m", "backends": ["http://x"]}]})
    assert config.routing.adapter_affinity is False and RoutingConfig().adapter_affinity
    with pytest.raises(ValueError, match="adapter_affinity"):
        RoutingConfig(adapter_affinity="no")  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("name", POLICIES)
def test_a_few_new_adapters_split_evenly(name: str) -> None:
    """By name alone, 4 adapters over 2 replicas split 3 and 1 (the bench's case): that
    replica thrashed among its three while the other idled with one."""
    names, rs = adapter_names(4), serving(replicas(2), adapter_names(4))
    by_name = Counter(rendezvous_order(a, [r.url for r in rs])[0] for a in names)
    assert sorted(by_name.values()) == [1, 3]
    assert sorted(Counter(homes(make_policy(name), rs, names).values()).values()) == [2, 2]
    names, rs = adapter_names(6), serving(replicas(4), adapter_names(6))
    assert sorted(Counter(homes(make_policy(name), rs, names).values()).values()) == [1, 1, 2, 2]
    # Scraped adapters count too: a replica with two loaded gets no new one until the other
    # holds as many.
    rs = serving(replicas(2), adapter_names(6), loaded=frozenset(adapter_names(2)))
    rs[1].loaded_adapters = frozenset()
    placed = homes(make_policy(name), rs, adapter_names(6)[2:])
    new = [placed[a] for a in adapter_names(6)[2:]]
    assert new[:2] == [rs[1].url, rs[1].url] and sorted(new[2:]) == [rs[0].url, rs[1].url]


def test_equal_adapters_held_the_fewest_in_flight_then_the_name_decide() -> None:
    policy, (a, b) = make_policy("least-load"), serving(replicas(2), ["sql"])
    assert rendezvous_order("sql", [a.url, b.url])[0] == a.url
    a.in_flight = 1
    assert policy.choose([a, b], RouteRequest(adapter="sql")) is b
    a.in_flight = 0
    assert make_policy("least-load").choose([a, b], RouteRequest(adapter="sql")) is a


def test_a_new_adapter_stays_on_its_replica_before_the_scrape_shows_it() -> None:
    clock = FakeClock()
    policy = AdapterAffinityPolicy(LeastLoadPolicy(), clock=clock)
    a, b = rs = serving(replicas(2), ["sql", "x", "y"])
    a.loaded_adapters = frozenset({"x"})  # a holds one adapter, b none: b loads "sql"
    request = RouteRequest(prefix="p" * 40, adapter="sql")
    assert rendezvous_order("sql", [a.url, b.url])[0] == a.url  # by name alone: a
    assert policy.choose(rs, request) is b
    # b now holds more adapters and more requests than a, and no scrape lists "sql" yet: its
    # requests stay on b (which has it in memory), each one renewing the record.
    b.loaded_adapters, b.in_flight = frozenset({"x", "y"}), 3  # within min_capacity 4
    for _ in range(5):
        clock.now += RECENT_S / 2
        assert policy.choose(rs, request) is b
    # No request for it in RECENT_S and still not listed loaded on b: the record is gone and
    # "sql" goes where the fewest adapters are, now a.
    clock.now += RECENT_S
    assert policy.choose(rs, request) is a
    assert policy.sent == {"sql": {a.url: clock.now}}  # b's old record was dropped


def test_the_scraped_state_decides_once_the_record_runs_out() -> None:
    clock = FakeClock()
    policy = AdapterAffinityPolicy(LeastLoadPolicy(), clock=clock)
    a, b = rs = serving(replicas(2), ["sql"])
    a.in_flight = 1
    request = RouteRequest(prefix="p" * 40, adapter="sql")
    assert policy.choose(rs, request) is b
    # The scrape lists "sql" loaded on a (another gateway placed it there) and not on b
    # (evicted): while its record lasts b holds it too, and both take the requests.
    a.in_flight, a.loaded_adapters = 0, frozenset({"sql"})
    assert {policy.choose(rs, request).url for _ in range(4)} == {a.url, b.url}
    clock.now += RECENT_S
    assert all(policy.choose(rs, request) is a for _ in range(6))


def test_a_spilled_adapter_stays_on_the_replica_it_spilled_to() -> None:
    clock = FakeClock()
    policy = AdapterAffinityPolicy(LeastLoadPolicy(), RoutingConfig(min_capacity=2), clock=clock)
    rs = serving(replicas(3), ["sql", "x"])
    rs[0].loaded_adapters = frozenset({"sql"})
    rs[1].loaded_adapters = frozenset({"x"})  # busier in adapters than rs[2]
    rs[0].in_flight = 2  # at its bound
    request = RouteRequest(prefix="p" * 40, adapter="sql")
    assert policy.choose(rs, request) is rs[2]
    rs[2].in_flight = 1
    assert policy.choose(rs, request) is rs[2]
    # Back within the bound, the loaded replica shares the adapter with the one it spilled to.
    rs[0].in_flight = rs[2].in_flight = 0
    assert {policy.choose(rs, request).url for _ in range(4)} == {rs[0].url, rs[2].url}
