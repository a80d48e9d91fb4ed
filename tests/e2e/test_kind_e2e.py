"""The kind end-to-end scenario as a pytest module (e2e/kind/kind_e2e.py has the steps).

Needs docker with a running engine, kind and kubectl, and is opt-in: it creates a cluster and
builds images (about 10-20 minutes), so `make test` on a laptop with Docker does not start one
by surprise. Run it with `ARGOSY_E2E_KIND=1 pytest tests/e2e/test_kind_e2e.py -v`, or run the
script with `make e2e-kind`. The tests run in file order and share one deployment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_scenario() -> ModuleType:
    name = "argosy_kind_e2e"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "e2e" / "kind" / "kind_e2e.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


scenario = _load_scenario()

_REASON = scenario.preflight()
if _REASON is None and os.environ.get("ARGOSY_E2E_KIND") != "1":
    _REASON = ("opt-in: set ARGOSY_E2E_KIND=1 to create a kind cluster and build images "
               "(or run `make e2e-kind`)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(_REASON is not None, reason=f"kind e2e: {_REASON}"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    kind = scenario.KindCluster(os.environ.get("ARGOSY_KIND_CLUSTER", "argosy-e2e"))
    kind.create()
    try:
        kind.build_and_load_images()
        kind.install_operator()
        yield kind
    finally:
        if os.environ.get("ARGOSY_KEEP_CLUSTER") != "1":
            kind.delete()


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What one test leaves for the next (the scenario is a sequence)."""
    return {}


def _with_diagnostics(cluster: Any, step: Any) -> Any:
    try:
        return step()
    except Exception:
        print(cluster.diagnostics(scenario.E2E_NAMESPACE))
        raise


def test_cpu_sample_becomes_ready(cluster: Any, state: dict[str, Any]) -> None:
    deployed = _with_diagnostics(cluster, lambda: scenario.deploy_sample(cluster))
    state["deployed"] = deployed
    deployment = scenario.owned_deployment(cluster, deployed)
    assert deployment["status"].get("readyReplicas", 0) >= 1


def test_completions_through_the_service(cluster: Any, state: dict[str, Any]) -> None:
    deployed = state.get("deployed") or pytest.skip("the LLMDeployment never became Ready")
    service, port = scenario.owned_service(cluster, deployed)
    with scenario.port_forward(cluster, deployed.namespace, service, port) as base_url:
        texts = _with_diagnostics(cluster, lambda: scenario.check_completions(base_url,
                                                                              deployed.model))
    assert all(text.strip() for text in texts)


def test_load_makes_the_autoscaler_add_a_replica(cluster: Any, state: dict[str, Any]) -> None:
    deployed = state.get("deployed") or pytest.skip("the LLMDeployment never became Ready")
    service, port = scenario.owned_service(cluster, deployed)
    with scenario.port_forward(cluster, deployed.namespace, service, port) as base_url:
        replicas = _with_diagnostics(cluster, lambda: scenario.autoscale_up(cluster, deployed,
                                                                            base_url))
    assert replicas >= 2

    def status_ready() -> int:
        live = cluster.get_json("llmd", deployed.name, "-n", deployed.namespace)
        return int(live.get("status", {}).get("readyReplicas", 0) or 0)

    # The operator reports the Deployment's ready replicas in the LLMDeployment's status.
    assert scenario.wait_until(lambda: status_ready() >= 2, timeout_s=120), status_ready()


def test_delete_leaves_no_children(cluster: Any, state: dict[str, Any]) -> None:
    deployed = state.get("deployed") or pytest.skip("the LLMDeployment never became Ready")
    assert scenario.children(cluster, deployed), "nothing owned by the LLMDeployment to delete"
    _with_diagnostics(cluster, lambda: scenario.delete_and_check_nothing_left(cluster, deployed))
    assert scenario.children(cluster, deployed) == []
