"""Rotary position embedding, applied to query and key in place.

`cos_sin_cache` [max_position, rot_dim] (float32) holds cos(pos * inv_freq) in its first
rot_dim / 2 columns and sin in the rest (vLLM's layout; `build_cos_sin_cache` makes one). The
first rot_dim of each head's head_dim are rotated, the rest are left alone (partial rotary).
  neox style (Llama in HF layout): pairs (x[i], x[i + rot_dim/2])
  GPT-J style (is_neox=False):     pairs (x[2i], x[2i + 1])
Each pair becomes (x1 * cos - x2 * sin, x2 * cos + x1 * sin), computed in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, next_pow2, triton_jit

if TYPE_CHECKING:
    import triton.language as tl


def build_cos_sin_cache(rot_dim: int, max_position: int, base: float = 10000.0,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Plain RoPE table [max_position, rot_dim] float32: cos then sin halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device)
                               / rot_dim))
    freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _pair_index(rot_dim: int, is_neox: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    half = torch.arange(rot_dim // 2, device=device)
    return (half, half + rot_dim // 2) if is_neox else (2 * half, 2 * half + 1)


def rotary_embedding_ref(
    positions: torch.Tensor,  # int [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], modified in place
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], modified in place
    cos_sin_cache: torch.Tensor,  # float32 [max_position, rot_dim]
    is_neox: bool = True,
) -> None:
    """Pure torch, in place."""
    rot_dim = cos_sin_cache.shape[1]
    cos_sin = cos_sin_cache[positions.long()].float()  # [num_tokens, rot_dim]
    cos, sin = cos_sin[:, None, : rot_dim // 2], cos_sin[:, None, rot_dim // 2:]
    i1, i2 = _pair_index(rot_dim, is_neox, query.device)
    for x in (query, key):
        if x is None:
            continue
        x1, x2 = x[..., i1].float(), x[..., i2].float()
        x[..., i1] = (x1 * cos - x2 * sin).to(x.dtype)
        x[..., i2] = (x2 * cos + x1 * sin).to(x.dtype)


@triton_jit
def _rotary_embedding_kernel(
    x_ptr,  # [T, HEADS, D] (query or key), rotated in place
    positions_ptr,  # [T]
    cos_sin_ptr,  # float32 [max_position, ROT_DIM]
    stride_t,
    stride_h,
    stride_cs,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < ROT_DIM // 2
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + ROT_DIM // 2 + j, mask=j_mask, other=0.0)
    if IS_NEOX:
        i1 = j
        i2 = j + ROT_DIM // 2
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    h = tl.arange(0, HEADS_PAD)
    mask = (h[:, None] < HEADS) & j_mask[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h
    x1 = tl.load(base + i1[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + i2[None, :], mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(base + i1[None, :], o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2[None, :], o2.to(x_ptr.dtype.element_ty), mask=mask)


def rotary_embedding(
    positions: torch.Tensor,  # int [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], modified in place
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], modified in place
    cos_sin_cache: torch.Tensor,  # float32 [max_position, rot_dim]
    is_neox: bool = True,
) -> None:
    """Triton RoPE in place (one program per token and tensor); contract of the `_ref`.

    query/key may be strided views (e.g. slices of a fused QKV output); head_dim must be
    contiguous.
    """
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be a [max_position, rot_dim] table with even "
                         "rot_dim, contiguous in its last dim")
    rot_dim = cos_sin_cache.shape[1]
    tensors = [x for x in (query, key) if x is not None]
    for x in tensors:
        if x.dim() != 3 or x.shape[0] != positions.shape[0] or x.stride(2) != 1:
            raise ValueError("query/key must be [num_tokens, heads, head_dim], contiguous in "
                             "head_dim, with num_tokens == len(positions)")
        if x.shape[2] < rot_dim:
            raise ValueError(f"rot_dim {rot_dim} exceeds head_dim {x.shape[2]}")
    check_device(positions, cos_sin_cache, *tensors)
    if positions.shape[0] == 0:
        return
    positions = positions.contiguous()  # read with a unit stride (no-op if it is)
    for x in tensors:
        _rotary_embedding_kernel[(x.shape[0],)](
            x, positions, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            HEADS=x.shape[1],
            HEADS_PAD=next_pow2(x.shape[1]),
            ROT_DIM=rot_dim,
            HALF_PAD=next_pow2(rot_dim // 2),
            IS_NEOX=is_neox,
            num_warps=4,
        )


__all__ = ["rotary_embedding", "rotary_embedding_ref", "build_cos_sin_cache"]
