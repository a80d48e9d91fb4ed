"""`Int8Linear`: weight-only int8 linear layer (symmetric, one scale per output channel).

Per call the layer picks its kernel by the number of tokens M:
- CPU, M = 1 (batch-1 decode): argosy_kernels.cpu_ops.int8_gemv where the fused CPU kernels
  build, which streams the weight at the memory bandwidth (22 vs 8.7 GB/s for
  `_weight_int8pack_mm` on a 53 MB weight here);
- CPU, M <= `packed_max_tokens`: a kernel that reads the int8 weight directly (half the bytes
  of bf16: decode is memory-bound, so this is the fast path): in bfloat16 argosy's few-row
  kernel (`cpu_ops.int8_linear`, 1.2-2.6x `_weight_int8pack_mm` here), else
  `torch.ops.aten._weight_int8pack_mm`;
- CPU, larger M: per-channel scales factor out of the dot product, so the "dequantization" is
  only an int8 -> dtype widening and the scale multiplies the output; `cpu_ops.int8_matmul`
  widens 16 rows at a time (bfloat16) or a cache-sized slice at a time (float32), never the
  whole weight (a fresh 56 MB tensor per call page-faults: 3x slower for the lm_head);
- CUDA: the Triton `w8a16_matmul` from argosy_kernels (imported lazily), or the same
  dequantize-then-GEMM when that kernel is unavailable.
On the CPU with the fused kernels built, one op makes the three-way choice
(`cpu_ops.int8_linear`, also used by `cpu_ops.decode_layer`); without them the layer takes
the packed kernel or `.to(dtype)`-then-GEMM by the same threshold. The crossover (see
docs/benchmarks/quantization.md) was measured on this project's CPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops
from torch import nn

from argosy_runtime.quantization.rtn import Int8Weight, quantize_int8

# Measured crossover: the few-row kernels cost ~linear time per token row, the many-row path
# a fixed int8->bf16 widening plus a product that grows slowly; they meet around 16 rows here.
INT8_PACKED_MAX_TOKENS = 16
_CPU_OPS_DTYPES = (torch.float32, torch.bfloat16)  # what the cpu_ops int8 kernels take


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + bias, with q int8 [N, K] and scale [N]."""

    packed_max_tokens: int = INT8_PACKED_MAX_TOKENS

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
                 ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                    device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device)
                             if bias else None)
        # Set by LlamaForCausalLM.use_batch_invariant_kernels: int8_matmul for every row count
        # (int8_linear picks a GEMV for one row and another kernel up to packed_max_tokens).
        self.batch_invariant = False

    @classmethod
    def from_weight(cls, weight: Int8Weight, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str | None = None) -> Int8Linear:
        """Build from a canonical int8 weight (q [N, K], float scale [N])."""
        n, k = weight.q.shape
        layer = cls(k, n, bias=bias is not None, dtype=dtype, device=device)
        layer.qweight.copy_(weight.q)
        layer.scales.copy_(weight.scale)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize an nn.Linear (round to nearest, per output channel)."""
        w = linear.weight.detach()
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_weight(quantize_int8(w), bias, dtype=w.dtype, device=w.device)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in the scales' dtype (the reference the kernels must match)."""
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        if x.device.type == "cuda":
            out = self._forward_cuda(x2, scales)
        elif self.batch_invariant:  # a token's result independent of the row count
            out = cpu_ops.int8_matmul(x2.contiguous(), self.qweight, scales)
        elif x.dtype in _CPU_OPS_DTYPES and cpu_ops.available():
            out = cpu_ops.int8_linear(x2.contiguous(), self.qweight, scales, self.packed_max_tokens)
        elif x2.shape[0] <= self.packed_max_tokens:
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, scales)
        else:
            out = F.linear(x2, self.qweight.to(x.dtype)) * scales
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*shape[:-1], self.out_features)

    def _forward_cuda(self, x2: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        kernel = _cuda_kernel()
        if kernel is None:
            return F.linear(x2, self.qweight.to(x2.dtype)) * scales
        return kernel(x2, self.qweight, scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-channel")


_KERNEL: list = []


def _cuda_kernel():  # -> Callable | None
    """argosy_kernels' Triton w8a16_matmul(x [M, K], qweight int8 [N, K], scales [N]) -> [M, N]."""
    if not _KERNEL:
        try:
            from argosy_kernels.w8a16_matmul import w8a16_matmul
        except ImportError:
            w8a16_matmul = None
        _KERNEL.append(w8a16_matmul)
    return _KERNEL[0]
