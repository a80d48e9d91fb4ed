"""Int8Linear / Int4Linear: the packed CPU kernels and the dequantize-then-GEMM path both
equal the dequantized reference, for token counts on either side of the crossover."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from argosy_runtime.quantization import Int4Linear, Int8Linear
from argosy_runtime.quantization.int4_linear import (
    fast_unpack_supported,
    pack_cpu,
    unpack_cpu,
)
from argosy_runtime.quantization.int8_linear import INT8_PACKED_MAX_TOKENS
from argosy_runtime.quantization.rtn import quantize_int4
from torch import nn


def _linear(k: int, n: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3.0)
        if bias:
            lin.bias.normal_()
    return lin.to(dtype)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == dtype
    # float32: the kernels only reorder sums; 16-bit: rounding of the inputs/outputs
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = ref.abs().amax().item()
    assert (out.float() - ref).abs().amax().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_paths_equal_dequantized_reference(dtype: torch.dtype, bias: bool) -> None:
    lin = _linear(192, 96, bias, dtype)
    layer = Int8Linear.from_linear(lin)
    w = layer.dequantize().float()
    assert ((w - lin.weight.float()).norm() / lin.weight.float().norm()) < 0.01
    for m in (1, 3, INT8_PACKED_MAX_TOKENS, INT8_PACKED_MAX_TOKENS + 1, 70):
        x = torch.randn(m, 192).to(dtype)
        ref = x.float() @ w.t() + (lin.bias.float() if bias else 0)
        _check(layer(x), ref, dtype)
    x3 = torch.randn(2, 5, 192).to(dtype)  # leading dims are kept
    assert layer(x3).shape == (2, 5, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n", "group_size"), [(256, 128, 32), (576, 192, 128), (576, 100, 64)])
def test_int4_paths_equal_dequantized_reference(dtype: torch.dtype, k: int, n: int,
                                                group_size: int) -> None:
    lin = _linear(k, n, True, dtype, seed=k + n)
    layer = Int4Linear.from_linear(lin, group_size)
    w = layer.dequantize().float()
    assert w.shape == (n, k)
    assert ((w - lin.weight.float()).norm() / lin.weight.float().norm()) < 0.15
    most = layer.packed_max_tokens  # the kernel's last row count, then dequantize-then-GEMM
    for m in (1, 2, 5, most, most + 1):
        x = torch.randn(m, k).to(dtype)
        _check(layer(x), x.float() @ w.t() + lin.bias.float(), dtype)


def test_int4_dequantize_matches_canonical_weight() -> None:
    lin = _linear(320, 64, False, torch.float32)
    canonical = quantize_int4(lin.weight.detach(), 64)
    layer = Int4Linear.from_weight(canonical, dtype=torch.float32)
    assert torch.equal(layer.unpacked()[:64], canonical.q)
    assert torch.allclose(layer.dequantize(), canonical.dequantize(), atol=1e-6)


def test_cpu_layout_unpack_both_ways() -> None:
    q = torch.randint(0, 16, (128, 96), dtype=torch.uint8)
    packed = pack_cpu(q)
    assert packed.shape == (128, 48)
    assert torch.equal(unpack_cpu(packed, 128, 96, 32), q)
    # 48 rows: not a whole block of 64, read back through the kernel itself
    assert not fast_unpack_supported(48)
    q48 = q[:48].contiguous()
    assert torch.equal(unpack_cpu(pack_cpu(q48), 48, 96, 32), q48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_cpu_layouts_agree(dtype: torch.dtype) -> None:
    """argosy's cpu_ops layout (the default where the kernels build) and PyTorch's packed
    layout hold the same weight and compute the same products."""
    from argosy_kernels import cpu_ops

    layer = Int4Linear.from_linear(_linear(576, 192, True, dtype, seed=7), 32)
    assert layer.layout == ("cpu_ops" if cpu_ops.available() else "cpu")
    q = layer.unpacked()
    x = torch.randn(3, 576).to(dtype)
    out = layer(x)
    for layout in ("cpu", "cpu_ops") if cpu_ops.available() else ("cpu",):
        layer.repack(layout)
        assert layer.layout == layout and torch.equal(layer.unpacked(), q)
        _check(layer(x), out.float(), dtype)


def test_int4_state_dict_loads_into_either_cpu_layout() -> None:
    from argosy_kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("one CPU layout only without the C++ kernels")
    source = Int4Linear.from_linear(_linear(256, 64, False, torch.bfloat16, seed=9), 32)
    source.repack("cpu")
    target = Int4Linear(256, 64, 32)
    assert target.layout == "cpu_ops"
    target.load_state_dict(source.state_dict())
    assert target.layout == "cpu_ops" and torch.equal(target.unpacked(), source.unpacked())
    x = torch.randn(2, 256).to(torch.bfloat16)
    _check(target(x), source(x).float(), torch.bfloat16)


def test_int4_input_permutation() -> None:
    # An act-order weight: inputs stored in group order, the layer permutes x to match.
    torch.manual_seed(3)
    w = torch.randn(64, 128)
    perm = torch.randperm(128)
    canonical = quantize_int4(w[:, perm], 32, clip_search=False)
    canonical.input_perm = perm
    layer = Int4Linear.from_weight(canonical, dtype=torch.float32)
    ref_w = canonical.dequantize()  # back in natural input order
    assert ((ref_w - w).norm() / w.norm()) < 0.15
    for m in (1, 100):
        x = torch.randn(m, 128)
        _check(layer(x), x @ ref_w.t(), torch.float32)


def test_int4_cuda_layout_matches_cpu_layout() -> None:
    """The layout `.to("cuda")` produces, evaluated with the Triton kernel's torch reference."""
    from argosy_kernels.w4a16_matmul import w4a16_matmul_ref

    lin = _linear(576, 192, False, torch.float32, seed=5)
    layer = Int4Linear.from_linear(lin, 128)
    x = torch.randn(4, 576)
    cpu_out = layer(x)
    layer.repack("cuda")
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (192, 640 // 8)
    xp = F.pad(x, (0, 640 - 576))
    out = w4a16_matmul_ref(xp, layer.qweight, layer.kernel_scales, layer.kernel_zeros, 128)
    _check(out, cpu_out.float(), torch.float32)
    layer.repack("cpu")  # and back
    _check(layer(x), cpu_out.float(), torch.float32)


def test_int8_cuda_contract_matches() -> None:
    from argosy_kernels.w8a16_matmul import w8a16_matmul_ref

    lin = _linear(128, 64, False, torch.float32)
    layer = Int8Linear.from_linear(lin)
    x = torch.randn(3, 128)
    _check(w8a16_matmul_ref(x, layer.qweight, layer.scales), layer(x).float(), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")
def test_cuda_forward_equals_cpu() -> None:
    for layer in (Int8Linear.from_linear(_linear(256, 128, True, torch.float16)),
                  Int4Linear.from_linear(_linear(576, 128, True, torch.float16), 64)):
        x = torch.randn(5, layer.in_features).half()
        ref = layer.float()(x.float())
        out = layer.to("cuda").half()(x.cuda())
        _check(out.cpu(), ref, torch.float16)
