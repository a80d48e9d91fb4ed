"""Decode attention over a paged KV cache.

Cache layout (shared by the torch and Triton paths, fixed in DESIGN.md):
  key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A sequence's token t lives in block block_tables[s, t // block_size] at row t % block_size.

int8 KV cache: the caches hold int8 and `k_scale`/`v_scale` (float16
[num_blocks, block_size, num_kv_heads], one scale per token per head) dequantize them in float32:
key = key_cache.float() * k_scale.float()[..., None]. `reshape_and_cache` writes both.

The Triton kernel runs one program per (sequence, kv head, context split). A program loads the
query rows of every query head that shares the kv head (GQA: padded to 16 rows so `tl.dot`
applies) and streams the sequence's K/V in tiles of TILE_N tokens, each token's block looked
up in the block table, with an online softmax. When the batch is too small to fill the GPU
(few sequences, long contexts) the context is cut into splits ("flash decoding"): each split
writes an unnormalised partial result with its running max and sum, and a second kernel
combines them. Nothing depends on host values of `context_lens`, so the launch can be captured
in a CUDA graph.

Sliding window (`sliding_window=W`, a Mistral / Qwen2 windowed layer): the query at position
ctx - 1 sees only the keys [ctx - W, ctx), as transformers' mask (p - W < k <= p). The kernel
starts at the window's first key and splits the window, never reading the blocks before it.

Soft-capping (`softcap=C`, Gemma 2's attn_logit_softcapping): every scaled score s becomes
C * tanh(s / C) before the softmax, as transformers' eager attention. The kernel works in the
log2 domain (s * log2(e)), where that is C' * tanh(s' / C') with C' = C * log2(e); it is a
compile-time branch (SOFTCAP), so the uncapped kernel is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import (
    check_device,
    interpret_mode,
    next_pow2,
    num_sms,
    triton_jit,
)
from argosy_kernels.reshape_and_cache import KV_SCALE_DTYPE

if TYPE_CHECKING:
    import triton.language as tl

_LOG2E = 1.4426950408889634
# Each split covers at least this many tokens: below it the combine step costs more than the
# extra parallelism buys.
_MIN_PARTITION = 256
_MAX_SPLITS = 64
# GPU launch configuration: tokens per K/V tile and warps per program (the interpreter uses
# 16-token tiles so that small tests still cross tiles). Compiled for sm_90 with bf16 and
# head_dim 128: 64 tokens x 8 warps needs 176 registers and no spills; 4 warps spilled.
GPU_TILE_N = 64
GPU_NUM_WARPS = 8


def paged_decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs], the current token included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # only the last W keys; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence against all of its cached tokens (pure torch), or its
    last `sliding_window` ones; with `softcap`, scores soft-capped before the softmax.

    Gathers each sequence's blocks into a dense [num_seqs, max_len] view, then does masked
    softmax attention in float32. GQA: query head h reads kv head h // (num_heads // num_kv_heads).
    With an int8 cache, pass the per-token-per-head `k_scale`/`v_scale`. A sequence with
    context length 0 yields zeros; slots past a context never reach the output.
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    # [num_seqs, max_len, num_kv_heads, head_dim]
    keys = key_cache[blocks].flatten(1, 2)[:, :max_len].float()
    values = value_cache[blocks].flatten(1, 2)[:, :max_len].float()
    if k_scale is not None:
        keys = keys * k_scale[blocks].flatten(1, 2)[:, :max_len, :, None].float()
    if v_scale is not None:
        values = values * v_scale[blocks].flatten(1, 2)[:, :max_len, :, None].float()
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", q, keys) * scale  # [s, kvh, group, max_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(max_len, device=query.device)
    pad = positions[None, :] >= context_lens[:, None].long()  # [num_seqs, max_len]
    if sliding_window is not None:
        pad |= positions[None, :] < context_lens[:, None].long() - sliding_window
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    # A sequence of context length 0 (a padded slot) has no key: its all -inf row's softmax is
    # NaN, zeroed here so it yields zeros, as the kernel does.
    probs = torch.softmax(scores, dim=-1).masked_fill(pad[:, None, None, :], 0.0)
    # Slots past a context (stale rows of its last block, spare block-table columns) may hold
    # anything, NaN included: a zero weight times NaN is NaN, so they are zeroed, not weighted.
    values = values.masked_fill(pad[:, :, None, None], 0.0)
    out = torch.einsum("skgt,stkd->skgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


@triton_jit
def _paged_decode_attention_kernel(
    out_ptr,  # [S, H, D] when NUM_SPLITS == 1, else float32 partial acc [S, H, NUM_SPLITS, D]
    m_ptr,  # float32 [S, H, NUM_SPLITS]: running max (log2 domain) of each split
    l_ptr,  # float32 [S, H, NUM_SPLITS]: running softmax denominator of each split
    q_ptr,  # [S, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,
    k_scale_ptr,  # float16 [NB, BS, KVH] (int8 cache only)
    v_scale_ptr,
    block_tables_ptr,  # int32 [S, MAX_BLOCKS]
    context_lens_ptr,  # int32 [S]
    scale_log2e,  # softmax scale * log2(e): the kernel works with exp2
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sb,  # scales: [NB, BS, KVH] with unit head stride
    stride_st,
    stride_bt,
    stride_os,
    stride_oh,
    partition_size,  # tokens per split, a multiple of TILE_N
    window,  # sliding window (SLIDING only): keys [ctx - window, ctx)
    softcap_log2e,  # soft cap * log2(e) (SOFTCAP only)
    softcap_exp,  # -2 / soft cap: tanh(u) = 2 / (1 + exp2(s * this)) - 1 (SOFTCAP only)
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # >= 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # dot in float32 (fp32 inputs; bf16 under the interpreter)
    DOT_PREC: tl.constexpr,
    SLIDING: tl.constexpr,  # a sliding window: the splits divide [ctx - window, ctx)
    SOFTCAP: tl.constexpr,  # scores -> softcap * tanh(scores / softcap)
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    if SLIDING:
        start = tl.maximum(ctx - window, 0) + split * partition_size
    else:
        start = split * partition_size
    end = tl.minimum(ctx, start + partition_size)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    head = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE_N):
        tok = tile_start + tl.arange(0, TILE_N)
        t_mask = tok < end
        blk = tl.load(
            block_tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=t_mask, other=0
        ).to(tl.int64)
        row = tok % BLOCK_SIZE
        # K^T tile [HEAD_DIM_PAD, TILE_N], V tile [TILE_N, HEAD_DIM_PAD]
        kt = tl.load(
            k_cache_ptr + blk[None, :] * stride_kb + row[None, :] * stride_kt
            + kvh * stride_kh + d[:, None],
            mask=d_mask[:, None] & t_mask[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + row[:, None] * stride_vt
            + kvh * stride_vh + d[None, :],
            mask=t_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if KV_INT8:
            kt = kt.to(tl.float32).to(q.dtype)
        elif UPCAST_DOT:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2e  # [GROUP_PAD, TILE_N]
        if KV_INT8:
            ks = tl.load(k_scale_ptr + blk * stride_sb + row * stride_st + kvh, mask=t_mask,
                         other=0.0).to(tl.float32)
            s = s * ks[None, :]
        if SOFTCAP:  # C' tanh(s / C'), tanh(u) = 2 / (1 + exp(-2u)) - 1 (exp2: 2 log2(e) u)
            # (the exponent clamped: past 64 tanh is -1 in float32 anyway, and exp2 never overflows)
            # fdiv: the approximate division (2 ulp), no IEEE slow path (a stack frame).
            e = tl.exp2(tl.minimum(s * softcap_exp, 64.0))
            s = softcap_log2e * (tl.fdiv(2.0, 1.0 + e) - 1.0)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_INT8:
            vs = tl.load(v_scale_ptr + blk * stride_sb + row * stride_st + kvh, mask=t_mask,
                         other=0.0).to(tl.float32)
            # p * vs relative to the tile's largest scale, which multiplies the dot: p * vs
            # itself falls into float16's subnormals when a head's values are small (vs below
            # 6e-5, values under 8e-3) and loses its digits there (5% off at values of 1e-4).
            vs_max = tl.max(vs, axis=0)
            p = p * (vs / tl.where(vs_max > 0, vs_max, 1.0))[None, :]
            v = v.to(tl.float32).to(q.dtype)
        elif UPCAST_DOT:
            v = v.to(tl.float32)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        if KV_INT8:
            pv = pv * vs_max
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    mask_out = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        # A sequence with no tokens (a padded CUDA-graph slot) yields zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_out,
        )
    else:
        ml_off = (seq * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(m_ptr + ml_off, m_i, mask=g_mask)
        tl.store(l_ptr + ml_off, l_i, mask=g_mask)
        tl.store(out_ptr + ml_off[:, None] * HEAD_DIM + d[None, :], acc, mask=mask_out)


@triton_jit
def _paged_decode_attention_reduce_kernel(
    out_ptr,  # [S, H, D]
    acc_ptr,  # float32 [S, H, NUM_SPLITS, D]
    m_ptr,  # float32 [S, H, NUM_SPLITS]
    l_ptr,
    stride_os,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    sp_mask = sp < NUM_SPLITS
    base = (seq * num_heads + head) * NUM_SPLITS
    m = tl.load(m_ptr + base + sp, mask=sp_mask, other=float("-inf"))
    lsum = tl.load(l_ptr + base + sp, mask=sp_mask, other=0.0)
    # Splits past the end of the context hold m = -inf, lsum = 0: weight 0. The clamp keeps an
    # all-empty row (context length 0) at 0 instead of NaN.
    m_max = tl.maximum(tl.max(m, axis=0), -1e30)
    w = tl.exp2(m - m_max)  # [SPLITS_PAD]
    acc = tl.load(
        acc_ptr + (base + sp[:, None]) * HEAD_DIM + d[None, :],
        mask=sp_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    denom = tl.sum(w * lsum, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _choose_splits(num_seqs: int, num_kv_heads: int, max_len: int, tile_n: int,
                   device: torch.device) -> int:
    """Splits per sequence so that num_seqs * num_kv_heads * splits fills the GPU twice over."""
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms(device)
    if programs >= target or max_len <= 2 * _MIN_PARTITION:
        return 1
    by_length = -(-max_len // _MIN_PARTITION)
    return max(1, min(-(-target // programs), by_length, _MAX_SPLITS))


def check_softcap(softcap: float | None) -> None:
    """ValueError unless `softcap` is None or a positive number."""
    if softcap is not None and (isinstance(softcap, bool) or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def check_paged_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Shape/dtype checks shared by the decode and prefill launchers (ValueError on misuse)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache/value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("key_cache/value_cache must be contiguous in head_dim")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be an int32 [num_seqs, max_blocks_per_seq] tensor")
    is_int8 = key_cache.dtype == torch.int8
    if is_int8 != (k_scale is not None) or is_int8 != (v_scale is not None):
        raise ValueError("k_scale and v_scale are required exactly when the cache dtype is int8")
    if is_int8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.shape != key_cache.shape[:3] or s.dtype != KV_SCALE_DTYPE or not s.is_contiguous():
                raise ValueError(
                    f"{name} must be a contiguous float16 [num_blocks, block_size, num_kv_heads] "
                    f"tensor, got {s.dtype} {tuple(s.shape)}"
                )
    elif key_cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} != query dtype {query.dtype}")


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs], the current token included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim], written in full
    num_splits: int | None = None,
    sliding_window: int | None = None,  # only the last W keys; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:
    """Triton paged decode attention; same contract as `paged_decode_attention_ref`.

    `num_splits` forces the number of context splits (None: chosen from the batch size, the
    block-table width (or the window, if shorter) and the GPU's SM count). No host sync: the
    launch is CUDA-graph safe, with the split count fixed by `block_tables.shape[1]` (the
    capture's maximum context). A sequence with context length 0 yields zeros.
    """
    check_paged_attention_inputs(query, key_cache, value_cache, block_tables, k_scale, v_scale)
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    check_softcap(softcap)
    num_seqs, num_heads, head_dim = query.shape
    # The kernel reads row `seq` of both for every sequence: fewer rows would be read out of
    # bounds (garbage, no error), and float lengths would be read as integer bits.
    if context_lens.dim() != 1 or context_lens.shape[0] < num_seqs \
            or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be an int32 [num_seqs = {num_seqs}] tensor, got "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")
    check_device(query, key_cache, value_cache, block_tables, context_lens)
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        # Row-major whatever query's layout: the kernel writes head_dim with a unit stride, and
        # empty_like would copy the strides of a permuted query.
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError("out must match query's shape and dtype, contiguous in head_dim")
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    # The kernel indexes a table row and the lengths with unit strides (a no-op when they
    # are contiguous, as the engine builds them: nothing is copied inside a CUDA graph).
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()

    interp = interpret_mode()
    # float32 (the exactness path, not a fast one): FMA dots need small tiles not to spill.
    fp32 = query.dtype == torch.float32
    tile_n = 16 if interp or fp32 else GPU_TILE_N
    max_len = block_tables.shape[1] * block_size  # an upper bound, known without a sync
    if sliding_window is not None:  # the keys a query sees: at most the window
        max_len = min(max_len, sliding_window)
    if num_splits is None:
        num_splits = 1 if interp else _choose_splits(
            num_seqs, num_kv_heads, max_len, tile_n, query.device
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    partition = -(-max(1, -(-max_len // num_splits)) // tile_n) * tile_n
    num_splits = max(1, -(-max_len // partition))
    group = num_heads // num_kv_heads
    is_int8 = key_cache.dtype == torch.int8
    upcast = query.dtype == torch.float32 or (interp and query.dtype == torch.bfloat16)
    k_s = k_scale if k_scale is not None else context_lens  # dummy pointer when unused
    v_s = v_scale if v_scale is not None else context_lens
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)

    if num_splits == 1:
        dst, m_buf, l_buf = out, out, out
        o_strides = (out.stride(0), out.stride(1))
    else:
        dst = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                          device=query.device)
        m_buf = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                            device=query.device)
        l_buf = torch.empty_like(m_buf)
        o_strides = (0, 0)
    _paged_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        dst, m_buf, l_buf, query, key_cache, value_cache, k_s, v_s, block_tables, context_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        *o_strides,
        partition,
        sliding_window or 0,
        (softcap or 0.0) * _LOG2E,
        -2.0 / softcap if softcap else 0.0,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        KV_INT8=is_int8,
        UPCAST_DOT=upcast,
        DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        num_warps=4 if fp32 else GPU_NUM_WARPS,
    )
    if num_splits > 1:
        _paged_decode_attention_reduce_kernel[(num_seqs, num_heads)](
            out, dst, m_buf, l_buf, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=next_pow2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
            num_warps=4,
        )
    return out


__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "check_paged_attention_inputs",
    "check_softcap",
]
