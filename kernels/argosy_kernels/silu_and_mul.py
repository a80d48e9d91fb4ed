"""SiLU-gated product of a gated MLP: out = silu(gate) * up, where gate and up are the two
halves of the fused gate_up projection's output.

One kernel instead of torch's two (F.silu writes [num_tokens, intermediate], the product reads
it back): in a decode step every layer runs it, and on a GPU each launch costs a few
microseconds whatever its size. Math in float32, rounded once to the input's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, triton_jit

if TYPE_CHECKING:
    import triton.language as tl


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure torch: gate_up [num_tokens, 2 * I] -> silu(gate) * up [num_tokens, I], the math in
    float32, one rounding to gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


@triton_jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    gate_up_ptr,  # [T, 2 * I]: gate then up
    stride_o,
    stride_g,
    I,  # noqa: E741 - the intermediate size, as in the model's config
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gate_up_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_g + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton silu(gate) * up; same contract as `silu_and_mul_ref`."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [num_tokens, 2 * intermediate], got "
                         f"{tuple(gate_up.shape)}")
    check_device(gate_up)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (num_tokens, inter) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError("out must be [num_tokens, intermediate] in gate_up's dtype, "
                         "contiguous in its last dimension")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, -(-inter // block))](
            out, gate_up, out.stride(0), gate_up.stride(0), inter, BLOCK=block, num_warps=4)
    return out


__all__ = ["silu_and_mul", "silu_and_mul_ref"]
