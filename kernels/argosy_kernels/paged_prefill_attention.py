"""Causal attention for a flattened batch of prompt chunks over the paged KV cache.

Prefix-cache hits and chunked prefill mean a chunk's earlier tokens may already sit in the
cache. The engine first writes the chunk's own K/V with `reshape_and_cache`, then calls this:
every key, old or new, is read from the cache.

Inputs (vLLM's varlen convention):
  query           [num_tokens, num_heads, head_dim], the chunks of all sequences back to back
  query_start_loc int32 [num_seqs + 1]: sequence s owns query rows [qsl[s], qsl[s + 1])
  seq_lens        int32 [num_seqs]: tokens in the cache after this chunk (chunk included)
The chunk of sequence s holds its LAST q_len = qsl[s+1] - qsl[s] positions, so query row i of
that chunk sits at position seq_len - q_len + i and attends to keys 0..that position.

The Triton kernel runs one program per (query tile of BLOCK_M rows, sequence, query head) and
streams keys in tiles of TILE_N tokens with an online softmax, stopping at the tile's causal
edge. Layout and int8 scales as in `paged_attention`.

Sliding window (`sliding_window=W`): row i sees keys p - W < k <= p of its position p; a query
tile's key loop starts at its first row's first key, so blocks before the window are not read.

Soft-capping (`softcap=C`, Gemma 2): scaled scores s -> C * tanh(s / C) before the causal mask
and the softmax (a compile-time branch, as in `paged_attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, interpret_mode, next_pow2, triton_jit
from argosy_kernels.paged_attention import check_paged_attention_inputs, check_softcap

if TYPE_CHECKING:
    import triton.language as tl

_LOG2E = 1.4426950408889634
# GPU launch configuration (query rows per program, key tokens per tile, warps). Compiled for
# sm_90 with bf16 and head_dim 128: 64 x 64 x 8 warps needs 224 registers and no spills
# (4 warps spilled).
GPU_BLOCK_M = 64
GPU_TILE_N = 64
GPU_NUM_WARPS = 8


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs], this chunk included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Pure-torch reference: per sequence, gather its cached K/V and run causal SDPA in float32
    (with a sliding window: each row's last `sliding_window` keys; with `softcap`, explicit
    attention with the scores soft-capped before the mask, as transformers' eager Gemma 2)."""
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, : -(-seq_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float()  # [seq_len, kvh, d]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
        if k_scale is not None:
            k = k * k_scale[blocks].flatten(0, 1)[:seq_len, :, None].float()
        if v_scale is not None:
            v = v * v_scale[blocks].flatten(0, 1)[:seq_len, :, None].float()
        q = query[q_start:q_end].float().transpose(0, 1)  # [heads, q_len, d]
        # Row i (position seq_len - q_len + i) may see keys 0..seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        allowed = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= torch.arange(seq_len, device=query.device)[None, :] > q_pos[:, None] - sliding_window
        if softcap is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )  # [heads, q_len, d]
        else:
            group = num_heads // num_kv_heads
            k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, seq_len, d]
            v = v.transpose(0, 1).repeat_interleave(group, dim=0)
            scores = torch.matmul(q, k.transpose(1, 2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), v)
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)
    return out


@triton_jit
def _paged_prefill_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,
    k_scale_ptr,  # float16 [NB, BS, KVH] (int8 cache only)
    v_scale_ptr,
    block_tables_ptr,  # int32 [S, MAX_BLOCKS]
    query_start_loc_ptr,  # int32 [S + 1]
    seq_lens_ptr,  # int32 [S]
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sb,
    stride_st,
    stride_bt,
    window,  # sliding window (SLIDING only): row at p sees keys p - window < k <= p
    softcap_log2e,  # soft cap * log2(e) (SOFTCAP only)
    softcap_exp,  # -2 / soft cap: tanh(u) = 2 / (1 + exp2(s * this)) - 1 (SOFTCAP only)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,  # scores -> softcap * tanh(scores / softcap), before the mask
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # tokens cached before this chunk

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    q_pos = prefix + rows  # [BLOCK_M]
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    qd_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=qd_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Keys past the last row's position are never seen by this tile; a tile wholly past the
    # chunk (the grid is sized for the longest chunk) does no work.
    kv_end = tl.minimum(seq_len, prefix + (q_tile + 1) * BLOCK_M)
    kv_end = tl.where(q_tile * BLOCK_M < q_len, kv_end, 0)
    if SLIDING:  # keys before the first row's window are seen by no row of this tile
        kv_start = tl.maximum(prefix + q_tile * BLOCK_M - window + 1, 0)
    else:
        kv_start = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(kv_start, kv_end, TILE_N):
        tok = tile_start + tl.arange(0, TILE_N)
        t_mask = tok < kv_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=t_mask,
                      other=0).to(tl.int64)
        row = tok % BLOCK_SIZE
        kt = tl.load(
            k_cache_ptr + blk[None, :] * stride_kb + row[None, :] * stride_kt
            + kvh * stride_kh + d[:, None],
            mask=d_mask[:, None] & t_mask[None, :],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + row[:, None] * stride_vt
            + kvh * stride_vh + d[None, :],
            mask=t_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if KV_INT8:
            kt = kt.to(tl.float32).to(q.dtype)
        elif UPCAST_DOT:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2e  # [BLOCK_M, TILE_N]
        if KV_INT8:
            ks = tl.load(k_scale_ptr + blk * stride_sb + row * stride_st + kvh, mask=t_mask,
                         other=0.0).to(tl.float32)
            s = s * ks[None, :]
        if SOFTCAP:  # C' tanh(s / C') in the log2 domain (paged_attention's kernel)
            # (the exponent clamped: past 64 tanh is -1 in float32 anyway, and exp2 never overflows)
            # fdiv: the approximate division (2 ulp), no IEEE slow path (a stack frame).
            e = tl.exp2(tl.minimum(s * softcap_exp, 64.0))
            s = softcap_log2e * (tl.fdiv(2.0, 1.0 + e) - 1.0)
        causal = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if SLIDING:
            causal = causal & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        # Every row sees key 0 in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if SLIDING:
            # Not so with a window: a later row's window may start past this tile. Its m_new is
            # then -inf; exponentiate against 0 instead, so every weight is 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
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

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs], this chunk included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    max_query_len: int | None = None,
    sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:
    """Triton varlen causal prefill over the paged cache; same contract as the `_ref`.

    `max_query_len` (the longest chunk, known to the scheduler) sizes the grid; when None it is
    read from `query_start_loc`, which costs a device-to-host sync.
    """
    check_paged_attention_inputs(query, key_cache, value_cache, block_tables, k_scale, v_scale)
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    check_softcap(softcap)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got "
                         f"{tuple(query_start_loc.shape)}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")
    # Float positions would be read as integer bits: garbage, no error.
    if query_start_loc.dtype not in (torch.int32, torch.int64) \
            or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_start_loc and seq_lens must be int32, got "
                         f"{query_start_loc.dtype} and {seq_lens.dtype}")
    check_device(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        # Row-major whatever query's layout: the kernel writes head_dim with a unit stride, and
        # empty_like would copy the strides of a permuted query.
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError("out must match query's shape and dtype, contiguous in head_dim")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    # The kernel indexes these with unit strides (a no-op when they are contiguous).
    block_tables = block_tables.contiguous()
    query_start_loc, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out

    interp = interpret_mode()
    block_m = 16 if interp else (GPU_BLOCK_M if head_dim <= 128 else GPU_BLOCK_M // 2)
    is_int8 = key_cache.dtype == torch.int8
    # int8 tiles add the dequantize and per-key scales: half-size key tiles avoid a spill.
    tile_n = 16 if interp else (GPU_TILE_N // 2 if is_int8 else GPU_TILE_N)
    num_warps = GPU_NUM_WARPS
    if query.dtype == torch.float32 and not interp:
        # The exactness path, not a fast one: FMA dots need small tiles not to spill.
        block_m, tile_n, num_warps = 32, 16, 4
    upcast = query.dtype == torch.float32 or (interp and query.dtype == torch.bfloat16)
    k_s = k_scale if k_scale is not None else seq_lens
    v_s = v_scale if v_scale is not None else seq_lens
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    grid = (-(-max_query_len // block_m), num_seqs, num_heads)
    _paged_prefill_attention_kernel[grid](
        out, query, key_cache, value_cache, k_s, v_s, block_tables, query_start_loc, seq_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        sliding_window or 0,
        (softcap or 0.0) * _LOG2E,
        -2.0 / softcap if softcap else 0.0,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        KV_INT8=is_int8,
        UPCAST_DOT=upcast,
        DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        num_warps=num_warps,
    )
    return out


__all__ = ["paged_prefill_attention", "paged_prefill_attention_ref"]
