"""The references are the CPU production path: importing the kernel modules must not import
Triton (import time, and machines without it)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, torch
import argosy_kernels.paged_attention, argosy_kernels.paged_prefill_attention
import argosy_kernels.reshape_and_cache, argosy_kernels.rms_norm, argosy_kernels.rotary_embedding
import argosy_kernels.w8a16_matmul, argosy_kernels.w4a16_matmul
from argosy_kernels.rms_norm import rms_norm_ref
rms_norm_ref(torch.ones(2, 8), torch.ones(8), 1e-6)
print("triton" in sys.modules)
"""


def test_kernel_modules_do_not_import_triton():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
