"""Fixtures for the operator tests: the emulated API server, a kubeconfig pointing at it, a
client for the test's own writes, and the real kopf operator running against it (the helpers
tests import are in operator_helpers.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import kmock
import pytest
from kopf.testing import KopfRunner
from kube_emulator import RESOURCES, SERVICEMONITORS, ArgosyKubeEmulator
from operator_helpers import Api

# The namespaced operator's ServiceMonitor recheck timer (its interval is fixed when
# argosy_operator.handlers is imported, after this conftest): short enough for a test to see
# a tick, long enough for `settle` to find the API quiet between two.
os.environ.setdefault("ARGOSY_SERVICEMONITOR_RECHECK_SECONDS", "2")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_servicemonitor: the emulated cluster lacks the "
                            "Prometheus Operator's ServiceMonitor CRD")


@pytest.fixture
async def kube(request: pytest.FixtureRequest) -> AsyncIterator[ArgosyKubeEmulator]:
    """The emulated API server (with the ServiceMonitor CRD unless marked `no_servicemonitor`)."""
    emulator = ArgosyKubeEmulator()
    async with emulator, kmock.Server(emulator):
        emulator.declare(RESOURCES)
        if request.node.get_closest_marker("no_servicemonitor") is None:
            emulator.declare(SERVICEMONITORS)
        yield emulator


@pytest.fixture
def kubeconfig(kube: ArgosyKubeEmulator, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emu, cluster: {{server: '{kube.url}'}}}}]\n"
        "users: [{name: test, user: {token: test-token}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: test}}]\n"
        "current-context: emu\n")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setenv("ARGOSY_WATCH_TIMEOUT", "30")
    return str(path)


@pytest.fixture
async def api(kube: ArgosyKubeEmulator) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as session:
        yield Api(session, str(kube.url))


@pytest.fixture
def run_operator(kubeconfig: str
                 ) -> Callable[..., contextlib.AbstractContextManager[KopfRunner]]:
    """`with run_operator(): ...` runs `kopf run -A --standalone -m argosy_operator.handlers`
    in a thread (the test's event loop keeps serving the emulated API meanwhile);
    `run_operator(namespace=NS)` runs it with `-n NS` instead of `-A`."""

    @contextlib.contextmanager
    def runner(namespace: str | None = None) -> Iterator[KopfRunner]:
        scope = ["-n", namespace] if namespace else ["-A"]
        with KopfRunner(["run", *scope, "--standalone", "-m", "argosy_operator.handlers"],
                        timeout=30) as kopf_runner:
            yield kopf_runner
        assert kopf_runner.exception is None, kopf_runner.output
        assert kopf_runner.exit_code == 0, kopf_runner.output

    return runner


