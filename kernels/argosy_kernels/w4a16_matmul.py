"""int4 weights (group-wise scales and zeros) x 16-bit activations.

Packing layout (the quantizer produces it with `pack_int4`):
  w_int   [N, K]        unsigned 4-bit values 0..15 (N = out_features, K = in_features, K % 8 == 0)
  qweight int32 [N, K // 8]: word (n, j) holds, in bits 4i..4i+3 (i = 0..7), the value
          w_int[n, i * (K // 8) + j]. The eight nibbles of a word are K // 8 apart, not
          adjacent: a kernel tile of words j0..j0+BK8 then yields, per nibble i, a contiguous
          run of K, i.e. eight ordinary [BLOCK_M, BK8] x [BK8, BLOCK_N] products, each word
          loaded once and no shuffle needed.
  scales  [N, K // group_size]  float (fp16/bf16/fp32), zeros [N, K // group_size] float, in
          units of the 4-bit code (asymmetric: an integer 0..15, or fractional for AWQ-style).
          Any strides: [N, K // group_size] contiguous is what the quantizer writes; the
          transpose of a contiguous [K // group_size, N] puts neighbouring columns' scales
          side by side, so a warp's scale loads coalesce.
  dequantized weight: w[n, k] = (w_int[n, k] - zeros[n, k // g]) * scales[n, k // g]
  out = x @ w.T, in x's dtype. group_size in {32, 64, 128} (any multiple of 8 dividing K works).

One row of x (decode of one sequence): `_w4a16_gemv_kernel`, FMA in float32 on one warp per
program. Up to DENSE_MIN_M rows (small batches): the fused tensor-core kernel, which reads
each packed word once per tile of rows and dequantizes it in registers. From DENSE_MIN_M on,
dequantizing per tile of M costs more than the bytes it saves: the launcher dequantizes the
whole weight once into x's dtype and hands the product to cuBLAS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, interpret_mode, triton_jit
from argosy_kernels.matmul_config import MatmulConfig, choose_split_k, split_k_buffer

if TYPE_CHECKING:
    import triton.language as tl


def pack_int4(w_int: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values [N, K] (any int dtype, 0..15) into int32 [N, K // 8]."""
    if w_int.dim() != 2 or w_int.shape[1] % 8:
        raise ValueError(f"w_int must be [N, K] with K % 8 == 0, got {tuple(w_int.shape)}")
    if w_int.numel() and (int(w_int.min()) < 0 or int(w_int.max()) > 15):
        raise ValueError("w_int values must lie in 0..15")
    n, k = w_int.shape
    nib = w_int.to(torch.int64).view(n, 8, k // 8)  # nib[n, i, j] = w_int[n, i * K/8 + j]
    shifts = (4 * torch.arange(8, device=w_int.device, dtype=torch.int64))[None, :, None]
    words = (nib << shifts).sum(dim=1)  # [N, K / 8], 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [N, K // 8] -> uint8 [N, K] values 0..15."""
    n, k8 = qweight.shape
    shifts = (4 * torch.arange(8, device=qweight.device, dtype=torch.int32))[None, :, None]
    nib = (qweight[:, None, :] >> shifts) & 0xF  # [N, 8, K/8]
    return nib.reshape(n, 8 * k8).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """Asymmetric min/max int4 quantization of w [N, K] -> (qweight, scales, zeros).

    scales/zeros come out in w's dtype; a round-trip helper for tests and benchmarks (the
    quantization package may pick its parameters differently, in the same layout).
    """
    n, k = w.shape
    if k % group_size or group_size % 8:
        raise ValueError(f"group_size {group_size} must be a multiple of 8 dividing K={k}")
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(1e-8)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 15).view(n, k)
    return pack_int4(q.to(torch.uint8)), scales.to(w.dtype), zeros.to(w.dtype)


def w4a16_dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """float32 [N, K] weights from the packed layout."""
    q = unpack_int4(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q - z) * s


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pure torch: x [M, K] @ dequant(qweight).T -> [M, N] in x's dtype (math in float32)."""
    w = w4a16_dequantize_ref(qweight, scales, zeros, group_size)
    return (x.float() @ w.T).to(x.dtype)


@triton_jit
def _w4a16_matmul_kernel(
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    x_ptr,  # [M, K]
    qweight_ptr,  # int32 [N, K8]
    scales_ptr,  # [N, K // GROUP_SIZE]
    zeros_ptr,  # [N, K // GROUP_SIZE]
    M,
    N,
    K8,  # K // 8
    stride_xm,
    stride_qn,
    stride_sn,
    stride_sg,  # scales/zeros may be [N, G] contiguous or the transpose of a [G, N] one
    stride_zn,  # (group-major: neighbouring columns' scales side by side, loads coalesce)
    stride_zg,
    stride_om,
    j_per_split,  # words per K split, a multiple of BLOCK_K8
    GROUP_SIZE: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,  # each (nibble, word tile) lies in one group
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K8: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    j_lo = pid_k * j_per_split
    j_hi = tl.minimum(K8, j_lo + j_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_K8):
        rj = j0 + tl.arange(0, BLOCK_K8)
        j_mask = rj < j_hi
        jn_mask = j_mask[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + rn64[None, :] * stride_qn + rj[:, None], mask=jn_mask,
                        other=0)  # int32 [BLOCK_K8, BLOCK_N]
        for i in tl.static_range(8):
            rk = i * K8 + rj  # the K index nibble i of these words stands for
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                        mask=m_mask[:, None] & j_mask[None, :], other=0.0)  # [BM, BK8]
            q = ((words >> (4 * i)) & 0xF).to(tl.float32)  # [BK8, BN]
            if UNIFORM_GROUP:
                grp = (i * K8 + j0) // GROUP_SIZE
                s = tl.load(scales_ptr + rn64 * stride_sn + grp * stride_sg, mask=n_mask,
                            other=0.0)
                z = tl.load(zeros_ptr + rn64 * stride_zn + grp * stride_zg, mask=n_mask,
                            other=0.0)
                # (q - z) s as q s - (z s), z s once per column: an FFMA a weight where the
                # subtraction and product were two (sm_90 loop at M = 16: 889 instructions
                # instead of 1001).
                s = s.to(tl.float32)[None, :]
                w = q * s - z.to(tl.float32)[None, :] * s
            else:
                grp = rk // GROUP_SIZE
                s = tl.load(scales_ptr + rn64[None, :] * stride_sn + grp[:, None] * stride_sg,
                            mask=jn_mask, other=0.0)
                z = tl.load(zeros_ptr + rn64[None, :] * stride_zn + grp[:, None] * stride_zg,
                            mask=jn_mask, other=0.0)
                w = (q - z.to(tl.float32)) * s.to(tl.float32)
            if UPCAST_DOT:
                x = x.to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PREC)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


@triton_jit
def _w4a16_gemv_kernel(
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    x_ptr,  # [M, K]
    qweight_ptr,  # int32 [N, K8]
    scales_ptr,  # [N, K // GROUP_SIZE]
    zeros_ptr,  # [N, K // GROUP_SIZE]
    M,
    N,
    K8,  # K // 8
    stride_xm,
    stride_qn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    j_per_split,  # words per K split, a multiple of 32 * VEC
    float_bits,  # 0x4B000000, see below
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,  # 32 * VEC divides GROUP_SIZE and K8
    GROUPS_PER_STEP: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One row of x (program axis 2) against BLOCK_N rows of the weight, on one warp.

    Each tile is [BLOCK_N, 32, VEC] words: thread t holds words t * VEC .. t * VEC + VEC - 1
    of every row and the x values they multiply, so nothing crosses threads before the final
    sum. With 32 * VEC dividing the group size, each nibble's run of a tile lies in one group:
    sum_k x (q - z) s = s sum_k x q - sum_k x z s, the first per tile and nibble, the second
    once per row from each group's sum of x."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    j_lo = pid_k * j_per_split
    j_hi = tl.minimum(K8, j_lo + j_per_split)
    acc = tl.zeros([BLOCK_N, 32], tl.float32)
    # Loads are of whole rows of the tile, [BLOCK_N, 32 * VEC] and [32 * VEC], reshaped to
    # [BLOCK_N, 32, VEC] and [32, VEC]: a 2D load is contiguous along its rows, so Triton
    # (3.6 and 3.9 checked) lays it out with thread t on words t * VEC .. t * VEC + VEC - 1
    # (a 3D load left the order of its other two axes to the version: Triton 3.6 spread rows
    # over threads and moved x through shared memory in every iteration).
    rj_tile = tl.arange(0, 32 * VEC)
    # The next tile's words load while this one is summed: with a few one-warp programs per
    # SM (N = 4096 makes 512 of them) nothing else would hide the memory latency.
    w_rows = qweight_ptr + rn64[:, None] * stride_qn
    rj = j_lo + rj_tile
    next_words = tl.load(w_rows + rj[None, :], mask=n_mask[:, None] & (rj < j_hi)[None, :],
                         other=0)
    for j0 in range(j_lo, j_hi, 32 * VEC):
        rj = j0 + rj_tile
        j_mask = rj < j_hi
        words = tl.reshape(next_words, (BLOCK_N, 32, VEC))
        next_words = tl.load(w_rows + 32 * VEC + rj[None, :],
                             mask=n_mask[:, None] & (rj + 32 * VEC < j_hi)[None, :], other=0)
        high = words >> 16
        for i in tl.static_range(8):
            # Nibble i where it sits in its 16-bit half (p = i % 4), as a float:
            # 0x4B000000 | (q << 4p) is 2^23 + q * 16^p exactly, so one LOP3 and a
            # subtraction replace a shift, a mask and an int-to-float conversion. (The
            # constant comes in as an argument: as a literal, ptxas rebuilt it in a register
            # before most LOP3s, a tenth more instructions in this loop.)
            half = words if i < 4 else high
            q = ((half & (0xF << (4 * (i % 4)))) | float_bits).to(tl.float32, bitcast=True)
            q = q - 8388608.0
            x = tl.load(x_row + i * K8 + rj, mask=j_mask, other=0.0)
            x = tl.reshape(x, (32, VEC)).to(tl.float32)
            qx = tl.sum(q * x[None, :, :], axis=2)  # [BLOCK_N, 32]: 16^p * sum_k q x
            grp = (i * K8 + j0) // GROUP_SIZE
            s = tl.load(scales_ptr + rn64 * stride_sn + grp * stride_sg, mask=n_mask,
                        other=0.0).to(tl.float32)
            acc += (s * (1.0 / 16.0 ** (i % 4)))[:, None] * qx
    res = tl.sum(acc, axis=1)
    if pid_k == 0:  # the zero points' part, for all of K, by the first split only
        for g0 in range(0, 8 * K8 // GROUP_SIZE, GROUPS_PER_STEP):
            rg = g0 + tl.arange(0, GROUPS_PER_STEP)
            g_mask = rg < 8 * K8 // GROUP_SIZE
            rk = rg[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
            x_sums = tl.sum(tl.load(x_row + rk, mask=g_mask[:, None], other=0.0)
                            .to(tl.float32), axis=1)  # [GROUPS_PER_STEP]
            sz_mask = n_mask[:, None] & g_mask[None, :]
            s = tl.load(scales_ptr + rn64[:, None] * stride_sn + rg[None, :] * stride_sg,
                        mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + rn64[:, None] * stride_zn + rg[None, :] * stride_zg,
                        mask=sz_mask, other=0.0).to(tl.float32)
            res -= tl.sum(s * z * x_sums[None, :], axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + pid_m * stride_om + rn, res.to(out_ptr.dtype.element_ty),
                 mask=n_mask)
    else:
        tl.store(out_ptr + (pid_k * M + pid_m) * N + rn, res, mask=n_mask)


@triton_jit
def _w4a16_dequantize_kernel(
    out_ptr,  # [N, K] in the activations' dtype
    qweight_ptr,  # int32 [N, K8]
    scales_ptr,  # [N, K // GROUP_SIZE]
    zeros_ptr,  # [N, K // GROUP_SIZE]
    N,
    K8,
    stride_qn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    GROUP_SIZE: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,  # each (nibble, word tile) lies in one group
    BLOCK_N: tl.constexpr,
    BLOCK_K8: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.program_id(1) * BLOCK_K8 + tl.arange(0, BLOCK_K8)
    rn64 = rn.to(tl.int64)
    mask = (rn < N)[:, None] & (rj < K8)[None, :]
    words = tl.load(qweight_ptr + rn64[:, None] * stride_qn + rj[None, :], mask=mask, other=0)
    for i in tl.static_range(8):
        rk = i * K8 + rj
        if UNIFORM_GROUP:  # one scale and zero per row for this nibble's run of K
            grp = (i * K8 + tl.program_id(1) * BLOCK_K8) // GROUP_SIZE
            n_mask = rn < N
            s = tl.load(scales_ptr + rn64 * stride_sn + grp * stride_sg, mask=n_mask,
                        other=0.0).to(tl.float32)[:, None]
            z = tl.load(zeros_ptr + rn64 * stride_zn + grp * stride_zg, mask=n_mask,
                        other=0.0).to(tl.float32)[:, None]
        else:
            grp = rk // GROUP_SIZE
            s = tl.load(scales_ptr + rn64[:, None] * stride_sn + grp[None, :] * stride_sg,
                        mask=mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + rn64[:, None] * stride_zn + grp[None, :] * stride_zg,
                        mask=mask, other=0.0).to(tl.float32)
        w = (((words >> (4 * i)) & 0xF).to(tl.float32) - z) * s
        tl.store(out_ptr + rn64[:, None] * (8 * K8) + rk[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask)


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Triton: the [N, K] weights of the packed layout, in `dtype` (w4a16_dequantize_ref's
    values, rounded once)."""
    n, k8 = qweight.shape
    out = torch.empty(n, 8 * k8, dtype=dtype, device=qweight.device)
    # 8 warps: 80 registers a thread for sm_90 where 4 warps took 189 (tiles spread over
    # more threads), so more programs fit an SM to keep this memory-bound copy busy.
    # Words per tile: up to a group's worth, so that a tile of one nibble lies in one group.
    block_n = 32
    block_k8 = group_size if group_size < 64 and group_size & (group_size - 1) == 0 else 64
    _w4a16_dequantize_kernel[(-(-n // block_n), -(-k8 // block_k8))](
        out, qweight, scales, zeros, n, k8,
        qweight.stride(0), *scales.stride(), *zeros.stride(),
        GROUP_SIZE=group_size,
        UNIFORM_GROUP=k8 % group_size == 0 and group_size % block_k8 == 0,
        BLOCK_N=block_n, BLOCK_K8=block_k8, num_warps=8,
    )
    return out


# From this many rows of x on (prefill, batches of 64 sequences and more), dequantize once and
# call cuBLAS. On an H200 (docs/benchmarks/gpu.md, 2026-12-04) the fused kernel took 113-125 us
# at M=64 for 4096->14336 and 14336->4096 (35 us for 4096^2), where bf16 cuBLAS took 34-37 us
# (8 us): dequantizing once moves 146 MB (29 MB read, 117 MB of bf16 written; 42 MB for
# 4096^2), 37-55 us at 2.7-4 TB/s, so dense should take 71-92 us (20-25 us) there; at M=16 the
# fused kernel took 15-39 us, less than dequantizing alone. The crossover lies between; it is
# not measured yet (bench/gpu_matmul_tune.py times both at M = 16, 64, 256).
DENSE_MIN_M = 64


def default_config(m: int, dtype: torch.dtype, group_size: int) -> MatmulConfig:
    """Launch parameters for M rows of x on a GPU (M < DENSE_MIN_M).

    One row (decode of one sequence): the FMA kernel (`_w4a16_gemv_kernel`), 8 weight rows
    and up to 128 words a tile. Compiled for sm_90 (float32 scales, group-major), its loop
    issues ~42 instructions per packed word where the tensor-core kernel at M = 1 issues ~56
    (16-row dots for one row, staged through shared memory), at 119 registers a thread and no
    shared memory.
    Chosen from that count: not yet timed on a GPU (bench/gpu_matmul_tune.py compares both).
    More rows: tensor cores."""
    if m == 1:
        return MatmulConfig(block_m=1, block_n=8, block_k=128, num_warps=1, use_dot=False)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    # float32 tiles are twice the bytes: narrower N keeps the pipelined shared memory within
    # an SM's budget (checked by compiling for sm_90, see tests/kernels/test_sm90_compile.py).
    block_n = 64 if m <= 64 or dtype == torch.float32 else 128
    num_warps = 4 if block_m * block_n <= 16 * 64 and dtype != torch.float32 else 8
    # Words per tile dividing group_size: a tile of one nibble then never straddles groups when
    # K8 is a multiple of group_size. A power of two of at least 16 (tl.arange and tl.dot
    # need that): 16 for groups that 32 does not divide (8, 24, 40, ...: the scales are then
    # gathered per word where a tile straddles groups).
    return MatmulConfig(block_m=block_m, block_n=block_n,
                        block_k=32 if group_size % 32 == 0 else 16, num_warps=num_warps)


# Under the interpreter (CPU tests) small tiles keep the simulated programs cheap.
INTERPRET_CONFIG = MatmulConfig(block_m=16, block_n=32, block_k=16, split_k=1)
INTERPRET_GEMV_CONFIG = MatmulConfig(block_m=1, block_n=8, block_k=32, num_warps=1,
                                     use_dot=False, split_k=1)


def gemv_vec(block_k: int, group_size: int, k8: int) -> int | None:
    """Words each thread of the FMA kernel takes at once (its tile is 32 of them per row),
    the most of 4, 2, 1 that fits block_k with 32 * vec dividing both the group size and
    K // 8; None when even 32 words do not, or the group size is no power of two (the
    zero-point sums load whole groups with tl.arange, which needs one, e.g. not 96): the
    tensor-core kernel takes those shapes."""
    if group_size & (group_size - 1):
        return None
    for vec in (4, 2, 1):
        if 32 * vec <= block_k and group_size % (32 * vec) == 0 and k8 % (32 * vec) == 0:
            return vec
    return None


def w4a16_matmul(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # int32 [N, K // 8], see the module docstring
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor,  # [N, K // group_size]
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    config: MatmulConfig | None = None,  # None: by M (the module docstring)
) -> torch.Tensor:
    """Triton x @ dequant(qweight).T in x's dtype; contract of `w4a16_matmul_ref`.

    `config.use_dot=False` runs the FMA kernel, one row of x and one warp per program
    (block_m and num_warps do not apply), where its tile fits the shapes (`gemv_vec`); other
    shapes fall back to the tensor-core kernel."""
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError("x must be [M, K] and qweight int32 [N, K // 8]")
    M, K = x.shape
    N, K8 = qweight.shape
    if K != 8 * K8:
        raise ValueError(f"x has K={K} but qweight packs K={8 * K8}")
    if group_size <= 0 or group_size % 8 or K % group_size:
        raise ValueError(f"group_size must be a positive multiple of 8 dividing K={K}, "
                         f"got {group_size}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (N, K // group_size):
            raise ValueError(f"{name} must be [N, K // group_size] = {(N, K // group_size)}, "
                             f"got {tuple(t.shape)}")
    check_device(x, qweight, scales, zeros)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("out must be [M, N] in x's dtype, contiguous in N")
    if M == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    interp = interpret_mode()
    if config is None:
        if not interp and M >= DENSE_MIN_M:
            w = w4a16_dequantize(qweight, scales, zeros, group_size, x.dtype)
            return torch.matmul(x, w.T, out=out)
        if interp:
            config = INTERPRET_GEMV_CONFIG if M == 1 else INTERPRET_CONFIG
        else:
            config = default_config(M, x.dtype, group_size)
    vec = None if config.use_dot else gemv_vec(config.block_k, group_size, K8)
    if not config.use_dot and vec is None:  # no FMA tile divides the groups and K / 8
        config = INTERPRET_CONFIG if interp else default_config(max(M, 2), x.dtype, group_size)
    args = (x, qweight, scales, zeros, group_size, out, config)
    dst = _launch_gemv(*args, vec) if vec else _launch_dot(*args, interp)
    if dst is not out:
        out.copy_(dst.sum(0))
    return out


def _launch_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, out: torch.Tensor,
                 config: MatmulConfig, vec: int) -> torch.Tensor:
    (M, _), (N, K8) = x.shape, qweight.shape
    # The next tile in flight keeps each program's loads outstanding, so K splits only as the
    # tensor-core kernels' (unmeasured: the sweep times 1, 2 and 4 splits).
    split_k, j_per_split = choose_split_k(config, M * -(-N // config.block_n), K8, 32 * vec,
                                          x.device, min_blocks_per_split=1)
    dst = split_k_buffer(out, split_k)
    _w4a16_gemv_kernel[(-(-N // config.block_n), split_k, M)](
        dst, x, qweight, scales, zeros, M, N, K8,
        x.stride(0), qweight.stride(0), *scales.stride(), *zeros.stride(), out.stride(0),
        j_per_split, 0x4B000000,
        GROUP_SIZE=group_size,
        BLOCK_N=config.block_n,
        VEC=vec,
        # x tiles of the zero-point sums: 4096 values, 128 a thread.
        GROUPS_PER_STEP=max(1, 4096 // group_size),
        SPLIT_K=split_k,
        num_warps=1,
    )
    return dst


def _launch_dot(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int, out: torch.Tensor, config: MatmulConfig,
                interp: bool) -> torch.Tensor:
    (M, _), (N, K8) = x.shape, qweight.shape
    block_k8 = config.block_k
    uniform = K8 % group_size == 0 and group_size % block_k8 == 0
    grid_mn = (-(-M // config.block_m), -(-N // config.block_n))
    split_k, j_per_split = choose_split_k(config, grid_mn[0] * grid_mn[1], K8, block_k8,
                                          x.device, min_blocks_per_split=2)
    dst = split_k_buffer(out, split_k)
    _w4a16_matmul_kernel[(grid_mn[0], grid_mn[1], split_k)](
        dst, x, qweight, scales, zeros, M, N, K8,
        x.stride(0), qweight.stride(0), *scales.stride(), *zeros.stride(), out.stride(0),
        j_per_split,
        GROUP_SIZE=group_size,
        UNIFORM_GROUP=uniform,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K8=block_k8,
        SPLIT_K=split_k,
        UPCAST_DOT=x.dtype == torch.float32 or (interp and x.dtype == torch.bfloat16),
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        # The gathered scale/zero tiles of the non-uniform path and float32 tiles are large:
        # two pipeline stages keep shared memory under the sm_90 limit.
        num_stages=min(config.num_stages, 3 if uniform and x.dtype != torch.float32 else 2),
    )
    return dst


__all__ = [
    "DENSE_MIN_M",
    "pack_int4",
    "unpack_int4",
    "quantize_int4",
    "default_config",
    "gemv_vec",
    "w4a16_dequantize",
    "w4a16_dequantize_ref",
    "w4a16_matmul",
    "w4a16_matmul_ref",
]
