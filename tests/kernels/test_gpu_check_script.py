"""bench/gpu_check.py: a clear exit without a GPU; every section runs in --smoke mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_exits_with_a_clear_message_without_a_gpu(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr and "nothing was measured" in proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_smoke_mode_runs_every_section(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    sections = results["sections"]
    assert not [name for name, s in sections.items() if "error" in s], sections
    assert sections["correctness"]["all_ok"] is True
    assert sections["decode_attention"]["runs"] and sections["matmul"]["runs"]
    # The reference run really is the torch backend (on CUDA the engine defaults to Triton).
    assert sections["engine"]["backends"] == ["TorchAttentionBackend", "TritonAttentionBackend"]
    assert sections["engine"]["layer_ops"] == ["torch", "triton"]
    assert sections["engine"]["identical"] is True
    # Every weight kind through the end-to-end section (int4 was once skipped here, which hid
    # a bug that would have failed it on the GPU: the layer's CPU fast path left on).
    assert {r["weights"] for r in sections["e2e"]["runs"]} == {"bf16", "int8", "int4"}
