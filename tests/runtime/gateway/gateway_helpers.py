"""Small helpers shared by the gateway's tests: a one-model config, reading
argosy:gateway_requests_total from the gateway's /metrics, and waiting for a condition."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from argosy_runtime.gateway.config import GatewayConfig, HealthConfig, ModelRouteConfig

S = TypeVar("S")

FAKE_REPLICA = str(Path(__file__).with_name("fake_replica.py"))  # a replica command's script

# fake_replica.py, unless the file named by $FAIL_IF_EXISTS exists: then it exits 1 at once,
# like a replica whose model no longer loads.
FLAKY = f"""
import os, runpy, sys
if os.path.exists(os.environ["FAIL_IF_EXISTS"]):
    print("error: cannot load the model", flush=True)
    sys.exit(1)
sys.argv[0] = {FAKE_REPLICA!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tiny_config(*urls: str, policy: str | None = None, **kw) -> GatewayConfig:
    """The model `tiny` on these backends; no health probes, so only the test's requests reach
    them. `policy` None: the routing's default."""
    kw.setdefault("health", HealthConfig(interval_s=60))
    return GatewayConfig(
        models=(ModelRouteConfig(name="tiny", backends=urls, policy=policy),), **kw)


async def requests_total(s: aiohttp.ClientSession, url: str, **labels: str) -> float:
    """argosy:gateway_requests_total for exactly these labels (0 when absent)."""
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if m and m.group(1) == "argosy:gateway_requests_total" and sorted(
                (m.group(2) or "").split(",")) == wanted:
            return float(m.group(3))
    return 0.0


async def all_counted(s: aiohttp.ClientSession, url: str) -> dict[tuple[str, str, str], float]:
    """Every argosy:gateway_requests_total sample: (model, backend, code) -> count."""
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for m in re.finditer(r'^argosy:gateway_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["model"], labels["backend"], labels["code"]] = float(m.group(2))
    return out


async def eventually(probe, timeout: float = 5.0) -> None:
    """Waits until `await probe()` is true; fails after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await probe():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def counts_a_499_not_a_200(s: aiohttp.ClientSession, url: str, backend: str) -> None:
    """After a client left mid-answer: waits until argosy:gateway_requests_total counts one 499
    for (`tiny`, `backend`), then checks that it counts no 200 there."""

    async def counted() -> bool:
        return await requests_total(s, url, model="tiny", backend=backend, code="499") == 1

    await eventually(counted)
    assert await requests_total(s, url, model="tiny", backend=backend, code="200") == 0


@asynccontextmanager
async def servers_of(kind: Callable[..., S]) -> AsyncIterator[Callable[..., Awaitable[S]]]:
    """`await make(*args)` builds `kind(*args)` and starts it; every one started is stopped
    at exit. The factory behind the fixtures that start fake servers of one kind."""
    started: list[Any] = []

    async def make(*args: Any) -> S:
        server: Any = kind(*args)
        await server.start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            await server.stop()
