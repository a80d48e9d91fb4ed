"""`argosy operator`: kopf with argosy_operator.handlers, in a separate process, no torch."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from argosy_runtime.cli.operator_cmd import add_parser, kopf_argv
from operator_helpers import NS, Api, eventually

# Block torch in the child: any `import torch` on the operator's path would fail loudly.
LAUNCH = ("import sys; sys.modules['torch'] = None; "
          "from argosy_runtime.cli.main import main; sys.exit(main(sys.argv[1:]))")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["operator", *argv])


def test_flags_map_to_kopf_run() -> None:
    assert kopf_argv(parse()) == ["run", "--standalone", "--all-namespaces", "-m",
                                  "argosy_operator.handlers"]
    assert kopf_argv(parse("-n", "ml", "-n", "dev-2", "--liveness",
                           "http://0.0.0.0:8080/healthz", "--verbose")) == [
        "run", "--standalone", "--namespace", "ml", "--namespace", "dev-2",
        "--liveness=http://0.0.0.0:8080/healthz", "--verbose", "-m",
        "argosy_operator.handlers"]


@pytest.mark.parametrize("value", ["dev-*", "ml-?", "!kube-system", "a,b", "ML", "ml-"])
def test_a_namespace_pattern_is_refused_not_silently_unwatched(value: str, capsys) -> None:
    """Scanning is off (handlers.py), so kopf keeps only exact names: `-n 'dev-*'` would
    leave the operator watching nothing, without an error."""
    with pytest.raises(SystemExit) as exit_info:
        parse("-n", value)
    assert exit_info.value.code == 2
    assert "not a namespace name" in capsys.readouterr().err


def test_kopf_drops_patterns_when_it_does_not_scan_namespaces() -> None:
    """Why the patterns above are refused (kopf's own fallback without scanning)."""
    from kopf._cogs.structs.references import select_specific_namespaces

    assert select_specific_namespaces(["ml", "dev-*", "ml-?", "!kube-system", "a,b"]) == {"ml"}


@pytest.mark.parametrize("kubeconfig_text,words", [
    (None, ["no Kubernetes credentials", "KUBECONFIG"]),  # two tracebacks, exit 1
    ("", ["/missing.yaml"]),  # a missing file: retried every 60 s forever
    ("clusters: []\n", ["context is not set"]),  # kopf's LoginError, retried forever too
])
def test_an_operator_without_usable_credentials_says_so_and_exits(
        tmp_path: Any, kubeconfig_text: str | None, words: list[str]) -> None:
    env = {**os.environ, "HOME": str(tmp_path)}  # no ~/.kube/config
    env.pop("KUBECONFIG", None)
    if kubeconfig_text == "":
        env["KUBECONFIG"] = str(tmp_path / "missing.yaml")
    elif kubeconfig_text is not None:
        (tmp_path / "config.yaml").write_text(kubeconfig_text)
        env["KUBECONFIG"] = str(tmp_path / "config.yaml")
    proc = subprocess.run([sys.executable, "-c", LAUNCH, "operator"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("argosy operator: error:"), proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
    assert all(word in proc.stderr for word in words), proc.stderr


async def test_argosy_operator_reconciles_without_torch(kube: Any, kubeconfig: str, api: Api
                                                        ) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCH, "operator", "-n", NS,
        env={**os.environ, "KUBECONFIG": kubeconfig},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        await api.call("POST", f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments", {
            "apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "cli", "namespace": NS},
            "spec": {"model": {"name": "m", "path": "smollm2-135m"}}}, "application/json")
        dep = await eventually(
            lambda: api.get_or_none(f"/apis/apps/v1/namespaces/{NS}/deployments/cli"),
            timeout=60, what="Deployment from `argosy operator`")
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert dep["spec"]["template"]["spec"]["containers"][0]["command"] == ["argosy"]
    assert proc.returncode == 0, output.decode()[-3000:]
    # With -n, kopf's scanning stays off (handlers.configure): with it, kopf would list and
    # watch namespaces, which the ClusterRole does not grant (nor CRDs there: not needed), and
    # the ServiceMonitor CRD handler is registered only clusterwide (its watch would list CRDs).
    scans = [str(r.url) for r in list(kube) if r.resource is not None
             and r.resource.plural in ("namespaces", "customresourcedefinitions")]
    assert scans == []
