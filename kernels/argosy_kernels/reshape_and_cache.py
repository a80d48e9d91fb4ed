"""Write new keys/values into their paged-cache slots.

`slot_mapping[t] = block * block_size + offset` names token t's slot in
`key_cache`/`value_cache` ([num_blocks, block_size, num_kv_heads, head_dim]); a negative slot
(a padded token, e.g. in a CUDA-graph batch) is skipped.

int8 cache: when the caches are int8 and `k_scale`/`v_scale` (float16
[num_blocks, block_size, num_kv_heads]) are given, each token's K and V are quantized per head,
symmetrically, in float32: s = float16(min(max|x| / 127, 65504)) (round to nearest even;
the clamp keeps it finite), q = round_half_away(x / s) clamped to [-127, 127], computed as
x * (1 / s) with s upcast to float32 (0 when s == 0). Quantizing against the float16-rounded
scale, not the float32 one, makes q * s the closest int8 grid point the stored scale allows.
The scale lands at the same slot in k_scale/v_scale; readers dequantize as
q.float() * s.float(). Per token per head that is head_dim + 2 bytes (66 for head_dim 64, vs
128 in bf16: 1.94x the tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, next_pow2, triton_jit

if TYPE_CHECKING:
    import triton.language as tl


# dtype of the int8 cache's k_scale/v_scale (what the runner allocates and every kernel checks).
KV_SCALE_DTYPE = torch.float16
# Largest finite float16: a scale above it (max|x| > ~8.3e6) is clamped rather than stored as inf.
_FP16_MAX = 65504.0


def quantize_per_head_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization over the last dim: x [..., D] -> (int8, float16 scale [...])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = (amax / 127.0).clamp_max(_FP16_MAX).to(torch.float16)
    sf = scale.float()
    # Quantize against the stored (float16-rounded) scale; an all-zero or underflowed head
    # stores zeros.
    inv = torch.where(sf > 0, 1.0 / sf.clamp_min(1e-30), torch.zeros_like(sf))
    y = xf * inv[..., None]
    # Round half away from zero (the kernel does the same; torch.round is half-to-even).
    y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5)).clamp_(-127, 127)
    return y.to(torch.int8), scale


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int [num_tokens]: block * block_size + offset
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K/V into its slot (pure torch); quantizes into an int8 cache."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if key_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:  # a plain cast would store truncated values
            raise ValueError("an int8 cache needs k_scale and v_scale")
        qk, sk = quantize_per_head_ref(key)
        qv, sv = quantize_per_head_ref(value)
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, qk)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, qv)
        k_scale.view(-1, num_kv_heads).index_copy_(0, slots, sk)
        v_scale.view(-1, num_kv_heads).index_copy_(0, slots, sv)
        return
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))


@triton_jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    key_cache_ptr,  # [NB, BS, KVH, D], addressed as [NB * BS] slots
    value_cache_ptr,
    k_scale_ptr,  # float16 [NB * BS, KVH] (QUANT only)
    v_scale_ptr,
    slot_mapping_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,  # key_cache stride between slots (= stride(1)), cache contiguous per block
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    # Padded tokens (slot < 0) store nothing. (The vector form of the test keeps the mask a
    # block, which the interpreter needs.)
    h_mask = (h < NUM_KV_HEADS) & ((h * 0 + slot) >= 0)
    mask = h_mask[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask,
                other=0.0)
    kc_off = slot * stride_kc_slot + h[:, None] * stride_kc_head + d[None, :]
    vc_off = slot * stride_vc_slot + h[:, None] * stride_vc_head + d[None, :]
    if QUANT:
        # Keys then values; written out twice because the lazily jitted kernels cannot share
        # a helper.
        # The scale is stored as float16 and the values quantized against that rounded
        # scale, exactly as `quantize_per_head_ref`.
        kf = k.to(tl.float32)
        k_amax = tl.max(tl.abs(kf), axis=1)  # [HEADS_PAD]
        ks = k_amax / 127.0
        ks = tl.where(ks > 65504.0, 65504.0, ks).to(tl.float16)  # NaN stays NaN
        ksf = ks.to(tl.float32)
        ky = kf * tl.where(ksf > 0, 1.0 / tl.maximum(ksf, 1e-30), 0.0)[:, None]
        ky = tl.where(ky >= 0, tl.floor(ky + 0.5), tl.ceil(ky - 0.5))
        ky = tl.minimum(tl.maximum(ky, -127.0), 127.0)
        tl.store(key_cache_ptr + kc_off, ky.to(tl.int8), mask=mask)
        tl.store(k_scale_ptr + slot * NUM_KV_HEADS + h, ks, mask=h_mask)
        vf = v.to(tl.float32)
        v_amax = tl.max(tl.abs(vf), axis=1)
        vs = v_amax / 127.0
        vs = tl.where(vs > 65504.0, 65504.0, vs).to(tl.float16)  # NaN stays NaN
        vsf = vs.to(tl.float32)
        vy = vf * tl.where(vsf > 0, 1.0 / tl.maximum(vsf, 1e-30), 0.0)[:, None]
        vy = tl.where(vy >= 0, tl.floor(vy + 0.5), tl.ceil(vy - 0.5))
        vy = tl.minimum(tl.maximum(vy, -127.0), 127.0)
        tl.store(value_cache_ptr + vc_off, vy.to(tl.int8), mask=mask)
        tl.store(v_scale_ptr + slot * NUM_KV_HEADS + h, vs, mask=h_mask)
    else:
        tl.store(key_cache_ptr + kc_off, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + vc_off, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int [num_tokens]: block * block_size + offset, < 0 skips
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton version of `reshape_and_cache_ref` (one program per token, all heads)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache/value_cache must be [num_blocks, block_size, num_kv_heads, "
                         "head_dim] and alike")
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key's "
                         f"{tuple(key.shape[1:])}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got "
                         f"{tuple(slot_mapping.shape)}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        # Slots are addressed as block * stride(0) == slot * stride(1): blocks must be dense.
        if c.stride(3) != 1 or c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"{name} must be contiguous within each block")
    quant = key_cache.dtype == torch.int8
    if quant:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.shape != key_cache.shape[:3] or s.dtype != KV_SCALE_DTYPE \
                    or not s.is_contiguous():
                raise ValueError(f"an int8 cache needs {name}: contiguous float16 "
                                 "[num_blocks, block_size, num_kv_heads]")
    check_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    slot_mapping = slot_mapping.contiguous()  # read with a unit stride (no-op if it is)
    k_s = k_scale if quant else slot_mapping  # dummy pointer when unused
    v_s = v_scale if quant else slot_mapping
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, k_s, v_s, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim),
        QUANT=quant,
        num_warps=4,
    )


__all__ = ["KV_SCALE_DTYPE", "reshape_and_cache", "reshape_and_cache_ref", "quantize_per_head_ref"]
