"""`argosy bench offline`: a short real run of ours alone (peers are measured by hand)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_offline_reports_tokens_per_second(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "argosy_runtime.cli.main", "bench", "offline", "--batch-sizes",
         "1,2", "--input-len", "8", "--output-len", "3", "--peers", "", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "batch | argosy tok/s"
    rows = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["argosy"] > 0 for r in rows)
