"""The CPU runtime image's command, run here with only that image's packages importable.

`argosy serve --model smollm2-135m` (the image's CMD, on a loopback port) starts in the import
sandbox of tests/images/image_closure.py, so a dependency the image lacks fails here. The kind
suite's own client steps then run against it: completions and chat through the `openai` client,
and the load generator that must make requests queue (what makes the autoscaler add a replica
on the cluster) with the e2e setting of two sequences per replica.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from image_closure import sandboxed_source
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _kind_scenario() -> ModuleType:
    name = "argosy_kind_e2e"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "e2e" / "kind" / "kind_e2e.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def runtime_cpu_server() -> Iterator[str]:
    pytest.importorskip("argosy_runtime.cli.serve", reason="argosy serve not built yet")
    scenario = _kind_scenario()
    port = _free_port()
    # The image's CMD, on loopback, with the e2e overrides' engine flags (two sequences at a
    # time, a small KV cache) so a handful of concurrent requests queue.
    argv = ["serve", "--model", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(scenario.E2E_SPEC_OVERRIDES["runtime"]["maxNumSeqs"]),
            *scenario.E2E_SPEC_OVERRIDES["runtime"]["extraArgs"],
            "--drain-timeout", "1"]  # teardown: abort the load's leftover requests
    code = f"import sys\nfrom argosy_runtime.cli.main import main\nsys.exit(main({argv!r}))\n"
    source = sandboxed_source("runtime-cpu", code, extra_requirements=("torch",))
    proc = subprocess.Popen([sys.executable, "-c", source], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"argosy serve exited {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        else:
            pytest.fail("argosy serve did not become ready in 240 s")
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _gauge(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not in /metrics")


def test_completions_with_the_kind_suite_client(runtime_cpu_server: str) -> None:
    texts = _kind_scenario().check_completions(runtime_cpu_server, "smollm2-135m")
    assert len(texts) == 2 and all(t.strip() for t in texts)


def test_kind_suite_load_makes_requests_queue(runtime_cpu_server: str) -> None:
    scenario = _kind_scenario()
    seen: list[float] = []

    def queued() -> bool:
        seen.append(_gauge(runtime_cpu_server, "argosy:num_requests_waiting"))
        return seen[-1] >= 1

    assert scenario.drive_load_until(runtime_cpu_server, "smollm2-135m", queued,
                                     concurrency=6, timeout_s=120, poll_s=1), seen
    assert _gauge(runtime_cpu_server, "argosy:num_requests_running") <= 2
