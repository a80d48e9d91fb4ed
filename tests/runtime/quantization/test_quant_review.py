"""Regression tests from a review of the quantization formats against their upstream specs."""

from __future__ import annotations

import torch
from argosy_kernels.w4a16_matmul import w4a16_dequantize_ref
from argosy_runtime.quantization.int4_linear import Int4Linear
from argosy_runtime.quantization.rtn import Int4Weight, quantize_int4


def test_int4_short_last_group_is_quantized_like_a_group_of_its_own() -> None:
    # 576 inputs at group 128 (SmolLM2): the last group holds 64 real inputs. Its clip search
    # must minimize their error alone; the replicated pad once counted 65 times.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 576, generator=gen)
    w[:, -1] *= 4
    last = quantize_int4(w, 128).dequantize()[:, 512:]
    alone = quantize_int4(w[:, 512:].contiguous(), 64).dequantize()
    assert torch.equal(last, alone)


def test_cuda_layout_keeps_groups_with_zero_scale() -> None:
    # A constant group c is scale 0, zero point c (GGUF Q4_1 with d = 0; load-time int4 in
    # float16, whose 1e-12 scale floor rounds to 0). The CUDA convention (q - zero) * scale
    # turned it into 0. Checked on the CPU through the kernel's torch reference.
    n, k, g = 16, 64, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    scales = torch.rand(n, k // g) * 0.1 + 0.01
    zeros = torch.randn(n, k // g) * 0.1
    scales[3, 0], zeros[3, 0] = 0.0, 0.5  # Q4_1 block with d = 0, m = 0.5
    scales[5, 1], zeros[5, 1] = 0.0, -2.25
    scales[7, 1], zeros[7, 1] = 0.0, 0.0  # all-zero group
    for dtype in (torch.bfloat16, torch.float16):
        layer = Int4Linear.from_weight(Int4Weight(q, scales, zeros, g, k), dtype=dtype)
        expected = layer.dequantize().float()
        assert expected[3, :g].eq(0.5).all() and expected[5, g:].eq(-2.25).all()
        layer.repack("cuda")
        got = w4a16_dequantize_ref(layer.qweight, layer.kernel_scales, layer.kernel_zeros, g)
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)
