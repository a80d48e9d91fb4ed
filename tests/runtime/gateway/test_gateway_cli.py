"""`argosy gateway` as a process: flags and YAML in, OpenAI traffic through, SIGTERM out."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
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
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    # On stderr, like every CLI error (`argosy gateway ... > log` must still show it).
    assert proc.returncode == 2 and b"models[tiny].policy" in err and not out


async def _start_gateway(backend: str, *flags: str) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "argosy_runtime.cli.main", "gateway", "--port", str(port),
        "--backend", f"tiny={backend}", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    await _wait_ready(url)
    return proc, url


async def _stream_then_sigterm(url: str, proc: asyncio.subprocess.Process) -> list[bytes]:
    """Stream a completion through the gateway; SIGTERM the gateway after the first chunk.
    Returns the data lines received (raises if the stream is cut)."""
    lines = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions",
                          json={"model": "tiny", "prompt": "x", "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data:"):
                    lines.append(line.strip())
                    if len(lines) == 1:
                        proc.send_signal(signal.SIGTERM)
    return lines


async def test_sigterm_lets_streams_in_flight_finish(fake_replicas) -> None:
    (replica,) = await fake_replicas(1)
    replica.chunk_delay, replica.num_chunks = 0.3, 8  # ~2.4 s of stream after the SIGTERM
    proc, url = await _start_gateway(replica.url)
    lines = await _stream_then_sigterm(url, proc)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert lines[-1] == b"data: [DONE]" and len(lines) == replica.num_chunks + 1
    assert proc.returncode == 0, out.decode()
    assert b"answers in flight may take up to 30s" in out


async def test_sigterm_cuts_what_runs_past_the_drain_timeout(fake_replicas) -> None:
    (replica,) = await fake_replicas(1)
    replica.chunk_delay, replica.num_chunks = 0.5, 120  # a minute of stream
    proc, url = await _start_gateway(replica.url, "--drain-timeout", "1")
    started = time.monotonic()
    with pytest.raises(aiohttp.ClientPayloadError):
        await _stream_then_sigterm(url, proc)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert time.monotonic() - started < 30  # cut after the drain timeout, not at the end
    assert proc.returncode == 0, out.decode()
    assert b"answers in flight may take up to 1s" in out


def test_ctrl_c_before_the_gateway_serves_exits_130(monkeypatch, capsys) -> None:  # noqa: ANN001
    """Ctrl-C that lands before run_gateway's signal handlers (the KeyboardInterrupt Python
    raises there) is an interrupted start: one line and 130, as `argosy serve` and `fleet`
    exit. It was 0, a success, for a gateway that never served."""
    from argosy_runtime.cli.main import main
    from argosy_runtime.gateway.proxy import app

    async def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(app, "run_gateway", interrupted)
    assert main(["gateway", "--backend", "tiny=http://127.0.0.1:9"]) == 130
    assert capsys.readouterr().err == "argosy gateway: interrupted\n"
