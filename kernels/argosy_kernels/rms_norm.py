"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

Without a residual: out = x * rsqrt(mean(x^2) + eps) * weight.
With one (the pre-norm transformer pattern `h = x + residual; out = norm(h)`): the sum
h = x + residual is rounded to x's dtype and written back into `residual` in place (it is the
next layer's residual), and out = norm(h). The statistics and the scaling are computed in
float32 and the result rounded once to x's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, next_pow2, triton_jit

if TYPE_CHECKING:
    import triton.language as tl


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden], updated in place
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure torch. Returns out, or (out, residual) with residual := x + residual."""
    if residual is not None:
        residual.copy_((x.float() + residual.float()).to(x.dtype))
        h = residual.float()
    else:
        h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (h * rstd * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


@triton_jit
def _rms_norm_kernel(
    out_ptr,  # [T, HIDDEN]
    x_ptr,  # [T, HIDDEN]
    residual_ptr,  # [T, HIDDEN] (HAS_RESIDUAL only), read and written
    weight_ptr,  # [HIDDEN]
    stride_o,
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like a torch add
        tl.store(residual_ptr + t * stride_r + cols, h, mask=mask)
        hf = h.to(tl.float32)
    else:
        hf = x.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / HIDDEN
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (hf * rstd * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden], updated in place
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm (one program per token); same contract as `rms_norm_ref`."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(1) != 1):
        raise ValueError("residual must match x's shape and dtype, contiguous in hidden")
    check_device(x, weight, *([residual] if residual is not None else []))
    num_tokens, hidden = x.shape
    if out is None:
        # Row-major whatever x's layout: the kernel writes hidden with a unit stride, and
        # empty_like would copy the strides of a transposed x.
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("out must match x's shape and dtype, contiguous in hidden")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if num_tokens:
        block = next_pow2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            out, x, residual if residual is not None else x, weight,
            out.stride(0), x.stride(0), residual.stride(0) if residual is not None else 0,
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, residual)


__all__ = ["rms_norm", "rms_norm_ref"]
