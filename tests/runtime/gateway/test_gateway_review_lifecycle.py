"""The gateway's lifecycle as a Kubernetes pod sees it: the drain on SIGTERM (runner.cleanup,
which run_gateway calls on the signal) ends within `drain_timeout_s`, so the pod exits before
its grace period's SIGKILL."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from argosy_runtime.gateway.proxy.app import Gateway, start_gateway
from gateway_helpers import eventually, tiny_config


@pytest.mark.parametrize("drain_s", [0.0, 2.0])
async def test_the_drain_cuts_a_stream_still_running_at_drain_timeout(fake_replicas,
                                                                      drain_s: float) -> None:
    """A stream still running when `drain_timeout_s` ends is cut then, its replica told (it
    frees the request's KV), and the stop goes on. aiohttp's drain only woke handlers reading
    the client's body: a relayed stream ran a second `drain_timeout_s` (60 s for the default
    30, past the pod's 45 s grace period), and a drain of 0 waited for the stream to end."""
    (replica,) = await fake_replicas(1)
    replica.chunk_delay, replica.num_chunks = 0.5, 60  # 30 s of stream
    runner, port = await start_gateway(
        Gateway(tiny_config(replica.url, drain_timeout_s=drain_s)), "127.0.0.1", 0)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                          json={"model": "tiny", "prompt": "x", "stream": True}) as resp:
            await resp.content.readline()  # the stream is flowing
            started = time.monotonic()
            await asyncio.wait_for(runner.cleanup(), drain_s + 3)
            took = time.monotonic() - started
            with pytest.raises(aiohttp.ClientPayloadError):  # cut, never a clean end
                await resp.read()
    assert drain_s - 0.1 <= took < drain_s + 1.0  # it took 2 * drain_s (and forever for 0)
    await eventually(lambda: asyncio.sleep(0, replica.disconnects == 1))
