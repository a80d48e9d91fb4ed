"""w4a16_matmul at group sizes other than 32/64/128 (8, 24, 40, 96: any multiple of 8 dividing
K is the documented contract), with the tiles its GPU configuration picks.

The tensor-core kernel's K tile must be a power of two (tl.arange) of at least 16 (tl.dot):
a tile of min(32, group_size) words failed to compile for groups 32 does not divide; and the
one-row FMA kernel loads whole groups with tl.arange, so a group of 96 (which its 32-word
tiles divide) failed there: such groups go to the tensor-core kernel. The interpreter does
not enforce either rule, so the tiles are compiled for sm_90 here (Triton's compiler and
bundled ptxas, no GPU: sm90_compile_check.py's harness) and their results checked under the
interpreter against the dense dequantized product.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from argosy_kernels.w4a16_matmul import (
    default_config,
    quantize_int4,
    w4a16_dequantize_ref,
    w4a16_matmul,
)
from kernel_test_utils import DEVICE, generator

# (group_size, rows of x): tensor-core tiles at 4 rows; one row falls back to them (the FMA
# kernel takes power-of-two groups of 32 words and more only).
CASES = [(8, 4), (24, 4), (40, 1), (96, 1)]

_COMPILE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import sm90_compile_check as c
m = c._patch_modules()
for g, rows in json.loads(sys.argv[2]):
    k = 8 * g * 3
    m["w4a16_matmul"].w4a16_matmul(torch.randn(rows, k, dtype=torch.bfloat16),
                                   torch.zeros(64, k // 8, dtype=torch.int32),
                                   torch.ones(k // g, 64).T, torch.ones(k // g, 64).T, g)
for kernel, args, kwargs in c._CALLS:
    try:
        c._compile(kernel, args, kwargs)
        print(json.dumps({"kernel": kernel.__name__, "BLOCK_K8": kwargs.get("BLOCK_K8")}))
    except Exception as e:
        print(json.dumps({"kernel": kernel.__name__, "error": str(e)[-500:]}))
"""


@pytest.mark.parametrize(("group_size", "rows"), CASES)
def test_gpu_tiles_compute_the_product(group_size, rows):
    g = generator(group_size)
    k, n = 8 * group_size * 3, 40
    qweight, scales, zeros = quantize_int4(torch.randn(n, k, generator=g), group_size)
    x = torch.randn(rows, k, generator=g)
    config = default_config(max(rows, 2), torch.float32, group_size)  # the tensor-core tiles
    got = w4a16_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
                       group_size, config=config)
    w = w4a16_dequantize_ref(qweight, scales, zeros, group_size).double()
    torch.testing.assert_close(got.double().cpu(), x.double() @ w.T, atol=1e-4, rtol=1e-4)


def test_gpu_tiles_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend is missing")
    here = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _COMPILE, here, json.dumps(CASES)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(CASES), proc.stdout
    assert not [r for r in results if "error" in r], results
