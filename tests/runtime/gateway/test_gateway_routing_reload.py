"""The config file's `routing` section (and each model's `policy`) reloaded while the gateway
runs (gateway/routing.py, through the same watcher as the tenants: proxy/tenant_gate.py). As
in test_gateway_tenants_reload.py, the file is a real one rewritten the way kubelet updates a
mounted ConfigMap, the gateway is started from it through the CLI (`load`) and re-reads it
every 50 ms, and requests go over real HTTP to fake replicas; `x-argosy-backend` says which
replica answered."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import yaml
from argosy_runtime.cli import gateway as cli
from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import GatewayConfig, RoutingConfig
from argosy_runtime.gateway.policies import RouteRequest, make_policy
from argosy_runtime.gateway.routing import Routing
from test_gateway_tenants_proxy import metric
from test_gateway_tenants_reload import FAILURES, LOGGER, REFUSED, Mount, args_for, until

PROMPT = "You are a careful assistant. " * 10 + "Question: what is a prefix cache?"  # ~320 chars
RELOADED = "routing reloaded"


def gateway_yaml(backends: list[str], routing: dict[str, Any] | None = None,
                 policy: str | None = None) -> str:
    model: dict[str, Any] = {"name": "tiny", "backends": backends}
    if policy is not None:
        model["policy"] = policy
    data: dict[str, Any] = {"models": [model], "health": {"interval_s": 60}}
    if routing is not None:
        data["routing"] = routing
    return yaml.safe_dump(data)


@pytest.fixture
async def started(fake_replicas, gateway, tmp_path):
    """`await started(n, routing=..., flags=...)` -> (mount, gateway, URL, replicas): a gateway
    on `n` fake replicas started through the CLI from a mounted file, re-reading it every
    50 ms; `flags`: CLI flags (argparse names) on top of the file."""

    async def start(n: int, routing: dict[str, Any] | None = None, **flags: Any):
        replicas = await fake_replicas(n)
        mount = Mount(tmp_path / "argosy")
        mount.write(gateway_yaml([r.url for r in replicas], routing))
        args = args_for(mount.path)
        for name, value in flags.items():
            setattr(args, name, value)
        config, config_file = cli.load(args)
        gw, url = await gateway(config, keys_poll_s=0.05, config_file=config_file)
        return mount, gw, url, replicas

    return start


async def backend(s: aiohttp.ClientSession, url: str, model: str = "tiny",
                  prompt: str = PROMPT) -> str:
    """The replica that answered one completion."""
    async with s.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt}) as r:
        assert r.status == 200
        await r.read()
        return r.headers["x-argosy-backend"]


async def backends(s: aiohttp.ClientSession, url: str, n: int = 4, **request: str) -> list[str]:
    """The replicas that answered `n` completions sent one after the other."""
    return [await backend(s, url, **request) for _ in range(n)]


def reloads(caplog: pytest.LogCaptureFixture, n: int) -> Callable[[], Awaitable[bool]]:
    """A check for `until`: the routing was reloaded `n` times."""
    async def check() -> bool:
        return len(reloaded(caplog)) >= n
    return check


def reloaded(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if RELOADED in r.getMessage()]


def restart_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "restart" in r.getMessage()]


async def test_adapter_affinity_off_applies_without_a_restart(started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, gw, url, (a, b) = await started(2, routing={"policy": "round-robin"})
    a.adapters = ["sql"]  # loaded on a; b serves it too but would load it first
    b.registered_adapters = ["sql"]
    await gw.health.probe_all()
    urls = [a.url, b.url]
    async with aiohttp.ClientSession() as s:
        assert await backends(s, url, model="sql") == [a.url] * 4  # where it is loaded
        mount.write(gateway_yaml(urls, {"policy": "round-robin", "adapter_affinity": False}))
        await until(reloads(caplog, 1))
        # The policy alone: round-robin over both replicas serving the adapter.
        assert set(await backends(s, url, model="sql")) == {a.url, b.url}
        mount.write(gateway_yaml(urls, {"policy": "round-robin"}))  # and back on
        await until(reloads(caplog, 2))
        assert await backends(s, url, model="sql") == [a.url] * 4
        assert await metric(s, url, FAILURES) == 0
    assert reloaded(caplog) == [
        f"{mount.path}: {RELOADED} (routing.adapter_affinity: true -> false)",
        f"{mount.path}: {RELOADED} (routing.adapter_affinity: false -> true)",
    ]
    assert not restart_warnings(caplog)


async def test_a_policy_switch_applies_and_prefix_affinity_keeps_what_it_learned(
        started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, gw, url, replicas = await started(2)  # prefix-affinity, the default
    pool, urls = gw.pools["tiny"], [r.url for r in replicas]
    async with aiohttp.ClientSession() as s:
        owner = await backend(s, url)  # the ring's pick for PROMPT
        (other,) = set(urls) - {owner}
        # The owner is past its bound: PROMPT spills to the other replica, which the prefix
        # table then remembers as holding it, ahead of the ring, once the owner is idle again.
        pool.get(owner).in_flight = 10
        assert await backend(s, url) == other
        pool.get(owner).in_flight = 0
        assert await backends(s, url) == [other] * 4
        # New prefix-affinity settings, same policy: the table is kept (a fresh one would
        # send PROMPT back to the ring's owner; load_factor does not move the ring), also
        # across a new block_chars (its entries digest the first k characters, whatever the
        # block size that cut them).
        mount.write(gateway_yaml(urls, {"load_factor": 2.0, "block_chars": 32}))
        await until(reloads(caplog, 1))
        assert await backends(s, url) == [other] * 4
        # The model's own policy: it applies live too, and is no restart.
        mount.write(gateway_yaml(urls, {"load_factor": 2.0, "block_chars": 32},
                                 policy="round-robin"))
        await until(reloads(caplog, 2))
        assert set(await backends(s, url)) == {owner, other}
        # Comments and formatting only: nothing to apply.
        mount.write(gateway_yaml(urls, {"load_factor": 2.0, "block_chars": 32},
                                 policy="round-robin") + "# reviewed\n")
        await until(lambda: _text_read(gw, mount))
        assert await metric(s, url, FAILURES) == 0
    assert reloaded(caplog) == [
        f"{mount.path}: {RELOADED} (routing.block_chars: 64 -> 32; "
        "routing.load_factor: 1.25 -> 2.0)",
        f"{mount.path}: {RELOADED} (policy of tiny: prefix-affinity -> round-robin)",
    ]
    assert not restart_warnings(caplog)


async def _text_read(gw, mount: Mount) -> bool:
    """Whether the gateway has read the file's current text (ConfigFile's last applied)."""
    return gw.config_file._text == mount.path.read_text()


async def test_an_invalid_routing_edit_is_refused_and_the_old_routing_serves(
        started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, _, url, replicas = await started(2)  # prefix-affinity: PROMPT sticks to one
    urls = [r.url for r in replicas]
    async with aiohttp.ClientSession() as s:
        (sticky,) = set(await backends(s, url))
        # A valid policy with an invalid knob next to it: nothing of it applies.
        mount.write(gateway_yaml(urls, {"policy": "round-robin", "load_factor": 0.5}))
        await until(lambda: _failures(s, url, 1))
        assert await backends(s, url) == [sticky] * 4
        assert await metric(s, url, REFUSED) == 1
        mount.write(gateway_yaml(urls, {"policy": "round-robin"}))  # fixed
        await until(reloads(caplog, 1))
        assert set(await backends(s, url)) == set(urls)
        assert await metric(s, url, REFUSED) == 0
        assert await metric(s, url, FAILURES) == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.startswith(f"{mount.path}: routing.load_factor: must be >= 1.0")
    assert "keeps serving its previous tenants (none) and routing" in error
    assert reloaded(caplog) == [
        f"{mount.path}: {RELOADED} (routing.policy: prefix-affinity -> round-robin)"]


async def _failures(s: aiohttp.ClientSession, url: str, n: int) -> bool:
    return await metric(s, url, FAILURES) == n


async def test_flags_still_override_a_reloaded_file(started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, _, url, replicas = await started(2, policy="prefix-affinity")
    urls = [r.url for r in replicas]
    async with aiohttp.ClientSession() as s:
        (sticky,) = set(await backends(s, url))
        mount.write(gateway_yaml(urls, {"policy": "round-robin", "min_capacity": 8}))
        await until(reloads(caplog, 1))
        assert await backends(s, url) == [sticky] * 4  # --policy still wins
    assert reloaded(caplog) == [f"{mount.path}: {RELOADED} (routing.min_capacity: 4 -> 8)"]


async def test_routing_applies_next_to_a_change_that_needs_a_restart(
        fake_replicas, started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, _, url, replicas = await started(2)
    (extra,) = await fake_replicas(1)
    urls = [r.url for r in replicas]
    async with aiohttp.ClientSession() as s:
        (sticky,) = set(await backends(s, url))
        # A new backend (a restart) and a new policy (live) in one edit.
        mount.write(gateway_yaml([*urls, extra.url], {"policy": "round-robin"}))
        await until(reloads(caplog, 1))
        assert set(await backends(s, url, n=6)) == set(urls)  # round-robin, old backends
        assert sticky in urls and not extra.requests
    (warning,) = restart_warnings(caplog)
    assert "gateway.yaml: models changed; only 'tenants', 'routing' and the models' 'policy' " \
           "apply while the gateway runs" in warning


# -- Routing and the policies' hand-over, without HTTP -----------------------------------------


def two_models(policy: str | None = None, **routing: Any) -> GatewayConfig:
    return GatewayConfig.from_dict({
        "models": [{"name": "tiny", "backends": ["http://10.0.0.1:8000"]},
                   {"name": "big", "backends": ["http://10.0.0.2:8000"], "policy": policy}],
        "routing": routing,
    })


def test_an_unchanged_routing_is_the_same_snapshot() -> None:
    routing = Routing.of(two_models("least-load"))
    # Another valid file with the same routing (say, tenants edited): nothing to apply.
    assert routing.reloaded(two_models("least-load")) is routing
    new = routing.reloaded(two_models(policy="round-robin", w_kv=0.5))
    assert dict(new.policy_names) == {"tiny": "prefix-affinity", "big": "round-robin"}
    assert new.config.w_kv == 0.5
    assert routing.changes(new) == ["routing.w_kv: 2.0 -> 0.5",
                                    "policy of big: least-load -> round-robin"]
    # A model the file no longer lists (a restart would drop it) keeps its policy.
    only_tiny = GatewayConfig.from_dict({
        "models": [{"name": "tiny", "backends": ["http://10.0.0.1:8000"]}],
        "routing": {"policy": "least-load"}})
    after = new.reloaded(only_tiny)
    assert dict(after.policy_names) == {"tiny": "least-load", "big": "round-robin"}
    assert new.changes(after) == ["routing.policy: prefix-affinity -> least-load",
                                  "routing.w_kv: 0.5 -> 2.0"]


def test_a_reloaded_adapter_policy_keeps_where_it_sent_each_adapter() -> None:
    a, b = Replica(url="http://10.0.0.1:8000"), Replica(url="http://10.0.0.2:8000")
    for r in (a, b):
        r.adapters = frozenset({"sql", "x", "y"})
    a.loaded_adapters = frozenset({"x"})  # b holds fewer adapters: b loads "sql"
    request = RouteRequest(prefix="p" * 40, adapter="sql")
    old = make_policy("least-load")
    assert old.choose([a, b], request) is b
    # b now holds more adapters than a, and no scrape lists "sql" on it yet: only the record
    # of where "sql" was sent keeps its requests on b, across a policy switch too (a fresh
    # record would make a, holding the fewest adapters, load it a second time).
    b.loaded_adapters = frozenset({"x", "y"})
    new = make_policy("round-robin", RoutingConfig(load_factor=2.0), previous=old)
    assert all(new.choose([a, b], request) is b for _ in range(4))
    assert make_policy("round-robin", RoutingConfig()).choose([a, b], request) is a
    # Turned off: the policy alone (round-robin), no record.
    off = make_policy("round-robin", RoutingConfig(adapter_affinity=False), previous=new)
    assert {off.choose([a, b], request).url for _ in range(2)} == {a.url, b.url}


def test_reloaded_prefix_affinity_trims_its_table_and_rebuilds_rings_only_when_needed() -> None:
    rs = [Replica(url=f"http://10.0.0.{i}:8000") for i in range(3)]
    old = make_policy("prefix-affinity", RoutingConfig(adapter_affinity=False))
    for i in range(20):
        old.choose(rs, RouteRequest(prefix=f"prompt {i:02d} " * 30))  # 300 chars: 4 blocks
    assert len(old._affinity) == 80
    same_ring = make_policy("prefix-affinity", RoutingConfig(adapter_affinity=False,
                                                             affinity_entries=50), previous=old)
    assert same_ring._affinity is old._affinity and len(same_ring._affinity) == 50
    assert same_ring._rings is old._rings
    new_ring = make_policy("prefix-affinity", RoutingConfig(virtual_nodes=40), previous=old)
    assert new_ring.inner._affinity is old._affinity and new_ring.inner._rings == {}
