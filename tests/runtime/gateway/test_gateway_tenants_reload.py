"""The config file's `tenants` section reloaded while the gateway runs (tenants/config_file.py,
proxy/tenant_gate.py). The file is a real one, rewritten the way kubelet updates a mounted
ConfigMap (a new folder, then the `..data` symlink swapped); the gateway is started from it
through the CLI (`load`), on a loopback port in front of a fake replica, or as an
`argosy gateway` process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from argosy_runtime.cli import gateway as cli
from argosy_runtime.fleet.replica_process import free_port
from argosy_runtime.gateway.config import GatewayConfig, TenantConfig
from argosy_runtime.gateway.tenants.config_file import ConfigFile, ConfigRefused
from test_gateway_cli import _wait_ready
from test_gateway_tenants_key_files import kubelet_mount
from test_gateway_tenants_proxy import metric

KEY_A, KEY_A2, KEY_B, KEY_C = "sk-a-reload", "sk-a2-reload", "sk-b-reload", "sk-c-reload"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
LOGGER = "argosy_runtime.gateway"
FAILURES = "argosy:gateway_config_reload_failures_total"
REFUSED = "argosy:gateway_config_refused"


def gateway_yaml(backend: str, tenants: list[dict[str, Any]] | None, **extra: Any) -> str:
    data: dict[str, Any] = {"models": [{"name": "tiny", "backends": [backend]}],
                            "health": {"interval_s": 60}, **extra}
    if tenants is not None:
        data["tenants"] = tenants
    return yaml.safe_dump(data)


class Mount:
    """A ConfigMap volume holding `gateway.yaml`, updated as kubelet does."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        self.version = 0

    @property
    def path(self) -> Path:
        return self.folder / "gateway.yaml"

    def write(self, text: str) -> None:
        self.version += 1
        kubelet_mount(self.folder, {"gateway.yaml": text}, version=self.version)


def args_for(path: Path) -> argparse.Namespace:
    return argparse.Namespace(config=str(path), host=None, port=None, policy=None, backend=[],
                              drain_timeout=None)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def status_of(s: aiohttp.ClientSession, url: str, key: str) -> int:
    """/v1/models with `key`: needs a key, takes nothing from any budget."""
    async with s.get(f"{url}/v1/models", headers=auth(key)) as resp:
        return resp.status


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll `check` until it holds, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "the change never applied"
        await asyncio.sleep(0.02)


def answers(s: aiohttp.ClientSession, url: str, key: str, status: int
            ) -> Callable[[], Awaitable[bool]]:
    """A check for `until`: `key` gets `status`."""
    async def check() -> bool:
        return await status_of(s, url, key) == status
    return check


def failures_are(s: aiohttp.ClientSession, url: str, n: int) -> Callable[[], Awaitable[bool]]:
    """A check for `until`: the reload failures counted are `n`."""
    async def check() -> bool:
        return await metric(s, url, FAILURES) == n
    return check


def logged(caplog: pytest.LogCaptureFixture, text: str) -> Callable[[], Awaitable[bool]]:
    """A check for `until`: a record holding `text` was logged."""
    async def check() -> bool:
        return any(text in r.getMessage() for r in caplog.records)
    return check


@pytest.fixture
async def started(fake_replicas, gateway, tmp_path):
    """`await started(tenants)` -> (mount, replica, gateway URL): a gateway started through the
    CLI from a mounted file, re-reading it every 50 ms."""

    async def start(tenants: list[dict[str, Any]]) -> tuple[Mount, Any, str]:
        (replica,) = await fake_replicas(1)
        mount = Mount(tmp_path / "argosy")
        mount.write(gateway_yaml(replica.url, tenants))
        config, config_file = cli.load(args_for(mount.path))
        _, url = await gateway(config, keys_poll_s=0.05, config_file=config_file)
        return mount, replica, url

    return start


async def test_keys_tenants_and_limits_apply_without_a_restart(started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, replica, url = await started([
        {"name": "a", "api_keys": [KEY_A], "requests_per_minute": 6},
        {"name": "b", "api_keys": [KEY_B]},
    ])
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A)) as resp:
            assert resp.status == 200
            assert resp.headers["x-ratelimit-remaining-requests"] == "5"
        assert await status_of(s, url, KEY_C) == 401
        # One ConfigMap edit: a's key rotated and its limit lowered, b removed, c added.
        mount.write(gateway_yaml(replica.url, [
            {"name": "a", "api_keys": [KEY_A2], "requests_per_minute": 3},
            {"name": "c", "api_keys": [KEY_C]},
        ]))
        await until(answers(s, url, KEY_C, 200))
        assert await status_of(s, url, KEY_A) == 401  # the removed key
        assert await status_of(s, url, KEY_B) == 401  # the removed tenant
        # a's new limit, with the request it made before the change still counted (a fresh
        # bucket of 3 would leave 2, then 1, then 0).
        for remaining in ("1", "0"):
            async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A2)) as resp:
                assert resp.status == 200
                assert resp.headers["x-ratelimit-limit-requests"] == "3"
                assert resp.headers["x-ratelimit-remaining-requests"] == remaining
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A2)) as resp:
            assert resp.status == 429
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_C)) as resp:
            assert resp.status == 200 and "x-ratelimit-limit-requests" not in resp.headers
        assert await metric(s, url, FAILURES) == 0
    assert len(replica.requests) == 4
    (applied,) = [r.getMessage() for r in caplog.records if "tenants reloaded" in r.message]
    assert "added: c; removed: b; changed: a" in applied and str(mount.path) in applied
    assert "sk-" not in caplog.text


async def test_an_invalid_file_keeps_the_previous_tenants(started, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, replica, url = await started([{"name": "a", "api_keys": [KEY_A]}])
    new_tenants = [{"name": "a", "api_keys": [KEY_A2]}]
    broken = [
        "tenants: [{name: a, api_keys: [" + KEY_A2,  # cut short: not YAML
        gateway_yaml(replica.url, [{"name": "a", "api_keys": [KEY_A2], "rpm": 5}]),
        gateway_yaml(replica.url, [*new_tenants, {"name": "c", "api_keys": [KEY_A2]}]),
        gateway_yaml(replica.url, [*new_tenants, {"name": "c", "api_keys_file": "/nowhere"}]),
        gateway_yaml(replica.url, new_tenants, max_attempts=0),  # another section invalid
    ]
    async with aiohttp.ClientSession() as s:
        for failures, text in enumerate(broken, start=1):
            mount.write(text)
            await until(failures_are(s, url, failures))
            assert await status_of(s, url, KEY_A) == 200
            assert await status_of(s, url, KEY_A2) == 401
            assert await metric(s, url, REFUSED) == 1  # for as long as the file stays so
        mount.write(gateway_yaml(replica.url, new_tenants))  # valid again
        await until(answers(s, url, KEY_A2, 200))
        assert await status_of(s, url, KEY_A) == 401
        assert await metric(s, url, REFUSED) == 0
        # Each broken file counted (and logged) once, however many polls it stayed.
        assert await metric(s, url, FAILURES) == len(broken)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == len(broken)
    assert all(e.startswith(f"{mount.path}: ") and "keeps serving its previous tenants (a)" in e
               for e in errors)
    assert "tenants[0].rpm: unknown field" in errors[1]
    assert "a key of 'c' is also a key of 'a'" in errors[2]
    assert "tenants[c].api_keys_file" in errors[3] and "max_attempts" in errors[4]
    assert "sk-" not in caplog.text


async def test_other_sections_need_a_restart_and_are_not_half_applied(fake_replicas, started,
                                                                      caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    mount, replica, url = await started([{"name": "a", "api_keys": [KEY_A]}])
    (other,) = await fake_replicas(1)
    # The backend and the health checks change along with the tenants (the routing section
    # applies live: test_gateway_routing_reload.py).
    mount.write(gateway_yaml(other.url, [{"name": "a", "api_keys": [KEY_A2]}],
                             health={"interval_s": 30}))
    async with aiohttp.ClientSession() as s:
        await until(answers(s, url, KEY_A2, 200))  # the tenants applied...
        async with s.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_A2)) as resp:
            assert resp.status == 200
        assert len(replica.requests) == 1 and not other.requests  # ...the route did not
        # Removing every tenant would open the gateway to anyone: it needs a restart too.
        mount.write(gateway_yaml(replica.url, None))
        await until(logged(caplog, "turning API keys off"))
        assert await status_of(s, url, KEY_A2) == 200
        assert await status_of(s, url, "") == 401
        assert await metric(s, url, FAILURES) == 0  # not failures: valid files
    (restart, _) = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name.endswith("config_file")]
    assert "models, health changed" in restart and "restart (roll) the gateway" in restart


async def test_requests_in_flight_finish_when_their_tenant_is_removed(fake_replicas, started
                                                                      ) -> None:
    mount, replica, url = await started([{"name": "a", "api_keys": [KEY_A]}])
    replica.chunk_delay = 0.25  # 4 chunks: a stream of about 1 s
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True},
                          headers=auth(KEY_A)) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            mount.write(gateway_yaml(replica.url, [{"name": "b", "api_keys": [KEY_B]}]))
            await until(answers(s, url, KEY_B, 200))
            assert await status_of(s, url, KEY_A) == 401
            assert replica.completed == 0  # still streaming when the change applied
            rest = await resp.read()  # the stream admitted before the change runs to its end
        assert first.startswith(b"data: ") and rest.rstrip().endswith(b"data: [DONE]")
        assert replica.completed == 1
        assert await metric(s, url, "argosy:gateway_tenant_requests_total", tenant="a",
                            code="200") == 1


async def test_the_gateway_process_reloads_a_swapped_configmap(fake_replicas, tmp_path) -> None:
    (replica,) = await fake_replicas(1)
    mount = Mount(tmp_path / "argosy")
    mount.write(gateway_yaml(replica.url, [{"name": "a", "api_keys": [KEY_A]}]))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "argosy_runtime.cli.main", "gateway", "--config", str(mount.path),
        "--port", str(port), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(url)
        async with aiohttp.ClientSession() as s:
            assert await status_of(s, url, KEY_A) == 200
            mount.write(gateway_yaml(replica.url, [{"name": "a", "api_keys": [KEY_A2]}]))
            # The process re-reads every 5 s (POLL_SECONDS).
            await until(answers(s, url, KEY_A2, 200), timeout=30)
            assert await status_of(s, url, KEY_A) == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, out.decode()
    assert b"tenants reloaded (added: none; removed: none; changed: a)" in out


# -- ConfigFile without HTTP ------------------------------------------------------------------


def config_file(tmp_path: Path, text: str) -> tuple[ConfigFile, list[str]]:
    """A ConfigFile of `text` in a real file, and the texts its parse was called with."""
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    parsed: list[str] = []

    def parse(new: str) -> GatewayConfig:
        parsed.append(new)
        return cli.build_config(args_for(path), new)

    return ConfigFile(str(path), text, parse(text), parse), parsed


def reread_tenants(file: ConfigFile) -> tuple[TenantConfig, ...] | None:
    """The tenants a reread applies: None when the text is unchanged or they may not apply."""
    reloaded = file.reread_config()
    return None if reloaded is None else reloaded.tenants


def test_an_unchanged_file_is_not_parsed_again(tmp_path) -> None:
    text = gateway_yaml("http://127.0.0.1:9", [{"name": "a", "api_keys": [KEY_A]}])
    file, parsed = config_file(tmp_path, text)
    assert [reread_tenants(file) for _ in range(3)] == [None, None, None]
    assert len(parsed) == 1  # at start-up only
    Path(file.path).write_text(text + "# a comment\n")
    tenants = reread_tenants(file)  # the same tenants: the gate finds nothing to apply
    assert tenants is not None and [t.name for t in tenants] == ["a"]
    assert reread_tenants(file) is None and len(parsed) == 2


def test_a_refusal_is_raised_once_per_problem_and_retried_until_valid(tmp_path) -> None:
    keys = tmp_path / "team-c"
    file, parsed = config_file(tmp_path, gateway_yaml("http://127.0.0.1:9", [
        {"name": "a", "api_keys": [KEY_A]}]))
    # A tenant added to the ConfigMap before its Secret's file is there (kubelet updates the
    # two volumes independently): refused, then applied once the file appears.
    Path(file.path).write_text(gateway_yaml("http://127.0.0.1:9", [
        {"name": "a", "api_keys": [KEY_A]}, {"name": "c", "api_keys_file": str(keys)}]))
    with pytest.raises(ConfigRefused, match=r"tenants\[c\]\.api_keys_file: cannot read"):
        reread_tenants(file)
    assert reread_tenants(file) is None and reread_tenants(file) is None  # the same problem: once
    keys.write_text(f"{KEY_C}\n")
    tenants = reread_tenants(file)
    assert tenants is not None and [t.name for t in tenants] == ["a", "c"]
    assert tenants[1].keys == (KEY_C,)
    Path(file.path).unlink()
    with pytest.raises(ConfigRefused, match="cannot read it"):
        reread_tenants(file)
    assert reread_tenants(file) is None
    assert len(parsed) == 5  # start-up, three tries of the refused file, the valid one


def test_turning_tenants_on_needs_a_restart(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    file, _ = config_file(tmp_path, gateway_yaml("http://127.0.0.1:9", None))
    Path(file.path).write_text(gateway_yaml("http://127.0.0.1:9", [
        {"name": "a", "api_keys": [KEY_A]}]))
    assert reread_tenants(file) is None and reread_tenants(file) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'tenants' was added; turning API keys on needs a restart" in warning
