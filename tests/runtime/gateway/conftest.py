"""Fixtures for gateway tests: fake replicas and gateways on loopback ports."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "server"))  # serve_harness
sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/runtime: http_helpers

from argosy_runtime.gateway.config import GatewayConfig  # noqa: E402
from argosy_runtime.gateway.proxy.app import Gateway, start_gateway  # noqa: E402
from fake_replica import FakeReplica  # noqa: E402


@pytest.fixture
async def fake_replicas() -> AsyncIterator[Callable[..., Awaitable[list[FakeReplica]]]]:
    """`await fake_replicas(n, model="tiny", **knobs)` -> started FakeReplicas."""
    started: list[FakeReplica] = []

    async def make(n: int, model: str = "tiny", **knobs: object) -> list[FakeReplica]:
        out = []
        for _ in range(n):
            r = FakeReplica(model=model, name=f"{model}{len(started)}", **knobs)  # type: ignore[arg-type]
            await r.start()
            started.append(r)
            out.append(r)
        return out

    yield make
    for r in started:
        await r.stop()


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Awaitable[tuple[Gateway, str]]]]:
    """`await gateway(config, **Gateway_options)` -> (Gateway, base URL), served on a free
    loopback port."""
    runners = []

    async def make(config: GatewayConfig, **options: Any) -> tuple[Gateway, str]:
        gw = Gateway(config, **options)
        runner, port = await start_gateway(gw, "127.0.0.1", 0)
        runners.append(runner)
        return gw, f"http://127.0.0.1:{port}"

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest) -> Any:
    """The test module's bench/ script (its `SCRIPT`), imported: the scripts are not a package."""
    script = request.module.SCRIPT
    spec = importlib.util.spec_from_file_location(f"{script.stem}_bench", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
