"""`argosy gateway` as a process: flags and YAML in, OpenAI traffic through, SIGTERM out."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
from argosy_runtime.fleet.replica_process import free_port


async def _wait_ready(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(f"{url}/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "gateway never became ready"
            await asyncio.sleep(0.1)


async def test_gateway_process_with_yaml_and_flags(fake_replicas, tmp_path: Path) -> None:
    a, b = await fake_replicas(2)
    (big,) = await fake_replicas(1, model="big")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(
        f"models:\n  - name: tiny\n    backends: [{a.url}]\n"
        "health: {interval_s: 0.2}\n"
        "cascades: [{name: auto, small: tiny, large: big, keywords: [prove]}]\n"
    )
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "argosy_runtime.cli.main", "gateway", "--config", str(cfg),
        "--port", str(port), "--backend", f"big={big.url}", "--policy", "round-robin",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(url)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json={"model": "auto", "prompt": "prove it"}) as resp:
                assert resp.status == 200 and resp.headers["x-argosy-backend"] == big.url
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200 and resp.headers["x-argosy-backend"] == a.url
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, out.decode()


async def test_gateway_rejects_bad_config(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("models: [{name: tiny, backends: [http://x], policy: fastest}]\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "argosy_runtime.cli.main", "gateway", "--config", str(cfg),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"models[tiny].policy" in out
