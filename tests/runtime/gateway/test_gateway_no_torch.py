"""The gateway (and the local fleet supervisor) never import torch: their images stay small."""

from __future__ import annotations

import subprocess
import sys

import pytest

GATEWAY_MODULES = [
    "argosy_runtime.gateway",
    "argosy_runtime.gateway.proxy.app",
    "argosy_runtime.gateway.backends.discovery",
    "argosy_runtime.gateway.cascade",
    "argosy_runtime.gateway.health",
    "argosy_runtime.gateway.metrics",
    "argosy_runtime.gateway.policies",
    "argosy_runtime.cli.gateway",
    "argosy_runtime.fleet",
    "argosy_runtime.cli.fleet",
]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: this test process may have imported torch for other tests.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_gateway_imports_no_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in GATEWAY_MODULES)
        + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        + "assert not bad, bad[:5]\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("command", ["gateway", "fleet"])
def test_cli_dispatch_imports_no_torch(command: str) -> None:
    """`argosy gateway|fleet` builds the whole CLI parser first: no subcommand may pull torch in
    at import time."""
    code = (
        "import sys\n"
        "from argosy_runtime.cli.main import build_parser\n"
        f"args = build_parser().parse_args(['{command}', '--help'])\n"
    )
    proc = _run(
        "import sys\n"
        "try:\n"
        + "".join("    " + line + "\n" for line in code.splitlines())
        + "except SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    assert proc.returncode == 0, proc.stderr
