"""int8 weights x 16-bit activations: out = x @ (w_int8 * scales[:, None]).T.

Weights are stored like a torch Linear's, [out_features N, in_features K], one float scale per
output channel (symmetric, per-channel). The kernel reads int8 tiles (half the bytes of bf16),
converts them to x's dtype in registers, accumulates in float32 and applies the scale per
output column at the end: on tensor cores, or for one row of x (decode of one sequence) in an
FMA kernel of one warp per program. For small M the K loop is split across programs when the
N tiles alone would not fill the GPU; partial sums land in a float32 buffer that is summed
afterwards (matmul_config.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, interpret_mode, triton_jit
from argosy_kernels.matmul_config import MatmulConfig, choose_split_k, split_k_buffer

if TYPE_CHECKING:
    import triton.language as tl


def w8a16_matmul_ref(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Pure torch: x [M, K] @ (w_int8 [N, K] * scales [N]).T -> [M, N] in x's dtype.

    Like the kernel: the product in float32, the per-channel scale applied to the result,
    one rounding to x's dtype at the end.
    """
    acc = x.float() @ w_int8.float().T  # [M, N]
    return (acc * scales.float()[None, :]).to(x.dtype)


@triton_jit
def _w8a16_matmul_kernel(
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    x_ptr,  # [M, K]
    w_ptr,  # int8 [N, K]
    scales_ptr,  # [N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < k_hi
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0)  # int8 [BLOCK_K, BLOCK_N]
        if UPCAST_DOT:
            x = x.to(tl.float32)
        acc += tl.dot(x, w.to(tl.float32).to(x.dtype), input_precision=DOT_PREC)
    scale = tl.load(scales_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


@triton_jit
def _w8a16_gemv_kernel(
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    x_ptr,  # [M, K]
    w_ptr,  # int8 [N, K]
    scales_ptr,  # [N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # multiple of 32 * VEC
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One row of x (program axis 2) against BLOCK_N rows of the weight, on one warp: a tile
    is [BLOCK_N, 32, VEC] weights, thread t holding the same VEC of every row and the x
    values they multiply, so nothing crosses threads before the final sum."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_N, 32], tl.float32)
    # Rows of the tile load as [BLOCK_N, 32 * VEC] and [32 * VEC], then reshape: see
    # _w4a16_gemv_kernel. The next tile loads while this one is summed (few one-warp
    # programs per SM: nothing else would hide the memory latency).
    rk_tile = tl.arange(0, 32 * VEC)
    # Weights are VEC bytes a thread, as many as its x values: their loads must not widen to
    # 16 bytes (then one thread's weights would meet two threads' x values).
    rk_w = tl.max_contiguous(rk_tile, VEC)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    rk = k_lo + rk_w
    next_w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < k_hi)[None, :], other=0)
    for k0 in range(k_lo, k_hi, 32 * VEC):
        rk = k0 + rk_tile
        w = tl.reshape(next_w, (BLOCK_N, 32, VEC))
        rk_next = k0 + 32 * VEC + rk_w
        next_w = tl.load(w_rows + rk_next[None, :],
                         mask=n_mask[:, None] & (rk_next < k_hi)[None, :], other=0)
        x = tl.reshape(tl.load(x_row + rk, mask=rk < k_hi, other=0.0), (32, VEC))
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :, :], axis=2)
    scale = tl.load(scales_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    res = tl.sum(acc, axis=1) * scale
    if SPLIT_K == 1:
        tl.store(out_ptr + pid_m * stride_om + rn, res.to(out_ptr.dtype.element_ty),
                 mask=n_mask)
    else:
        tl.store(out_ptr + (pid_k * M + pid_m) * N + rn, res, mask=n_mask)


def default_config(m: int, dtype: torch.dtype) -> MatmulConfig:
    """Launch parameters for M rows of x on a GPU.

    One row (decode of one sequence): the FMA kernel (`_w8a16_gemv_kernel`), 8 weight rows and
    256 K a tile, 8 bytes a thread and row (16 would put a thread's 16 bf16 x values in two
    threads' hands: shuffles in every iteration; 16 rows with the next tile in flight take
    156 registers). Compiled for sm_90 its loop issues 322 instructions per 64 weight bytes a
    thread with nothing between threads, at 71 registers, against the tensor-core kernel's
    16-row dots for one row staged through shared memory. Chosen from that: not yet timed on
    a GPU (bench/gpu_matmul_tune.py compares both). More rows: tensor cores."""
    if m == 1:
        return MatmulConfig(block_m=1, block_n=8, block_k=256, num_warps=1, use_dot=False)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    # float32 tiles are twice the bytes: narrower N keeps the pipelined shared memory within
    # an SM's budget (checked by compiling for sm_90, see tests/kernels/test_sm90_compile.py).
    block_n = 64 if m <= 64 or dtype == torch.float32 else 128
    num_warps = 4 if block_m * block_n <= 16 * 64 and dtype != torch.float32 else 8
    return MatmulConfig(block_m=block_m, block_n=block_n, block_k=64, num_warps=num_warps)


# Under the interpreter (CPU tests) small tiles keep the simulated programs cheap.
INTERPRET_CONFIG = MatmulConfig(block_m=16, block_n=32, block_k=32, split_k=1)
INTERPRET_GEMV_CONFIG = MatmulConfig(block_m=1, block_n=8, block_k=64, num_warps=1,
                                     use_dot=False, split_k=1)


def w8a16_matmul(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    w_int8: torch.Tensor,  # int8 [N, K]
    scales: torch.Tensor,  # [N]
    *,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
    config: MatmulConfig | None = None,  # None: default_config(M), or the interpreter's
) -> torch.Tensor:
    """Triton x @ (w_int8 * scales[:, None]).T in x's dtype; contract of `w8a16_matmul_ref`.

    `config.use_dot=False` runs the FMA kernel: one row of x and one warp per program
    (block_m and num_warps do not apply), tiles of block_k (a power of two, 32 to 512) of K."""
    if x.dim() != 2 or w_int8.dim() != 2 or x.shape[1] != w_int8.shape[1]:
        raise ValueError(f"x must be [M, K] and w_int8 [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w_int8.shape)}")
    if w_int8.dtype != torch.int8:
        raise ValueError(f"w_int8 must be int8, got {w_int8.dtype}")
    if scales.shape != (w_int8.shape[0],):
        raise ValueError(f"scales must be [N = {w_int8.shape[0]}], got {tuple(scales.shape)}")
    check_device(x, w_int8, scales)
    M, K = x.shape
    N = w_int8.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("out must be [M, N] in x's dtype, contiguous in N")
    if M == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w_int8 = w_int8 if w_int8.stride(1) == 1 else w_int8.contiguous()
    scales = scales.contiguous()  # read with a unit stride (no-op if it is)
    interp = interpret_mode()
    if config is None:
        if interp:
            config = INTERPRET_GEMV_CONFIG if M == 1 else INTERPRET_CONFIG
        else:
            config = default_config(M, x.dtype)
    if config.use_dot:
        dst = _launch_dot(x, w_int8, scales, out, config, interp)
    else:
        dst = _launch_gemv(x, w_int8, scales, out, config)
    if dst is not out:
        out.copy_(dst.sum(0))
    return out


def _launch_gemv(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor,
                 out: torch.Tensor, config: MatmulConfig) -> torch.Tensor:
    (M, K), N = x.shape, w_int8.shape[0]
    vec = min(16, max(1, config.block_k // 32))
    if vec & (vec - 1):
        raise ValueError(f"block_k must be a power of two for the FMA kernel, got "
                         f"{config.block_k}")
    # K splits as in w4a16's one-row launcher.
    split_k, k_per_split = choose_split_k(config, M * -(-N // config.block_n), K, 32 * vec,
                                          x.device, min_blocks_per_split=1)
    dst = split_k_buffer(out, split_k)
    _w8a16_gemv_kernel[(-(-N // config.block_n), split_k, M)](
        dst, x, w_int8, scales, M, N, K, x.stride(0), w_int8.stride(0), out.stride(0),
        k_per_split,
        BLOCK_N=config.block_n,
        VEC=vec,
        SPLIT_K=split_k,
        num_warps=1,
    )
    return dst


def _launch_dot(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor,
                out: torch.Tensor, config: MatmulConfig, interp: bool) -> torch.Tensor:
    (M, K), N = x.shape, w_int8.shape[0]
    grid_mn = (-(-M // config.block_m), -(-N // config.block_n))
    split_k, k_per_split = choose_split_k(config, grid_mn[0] * grid_mn[1], K, config.block_k,
                                          x.device, min_blocks_per_split=4)
    dst = split_k_buffer(out, split_k)
    _w8a16_matmul_kernel[(grid_mn[0], grid_mn[1], split_k)](
        dst, x, w_int8, scales, M, N, K, x.stride(0), w_int8.stride(0), out.stride(0),
        k_per_split,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split_k,
        UPCAST_DOT=x.dtype == torch.float32 or (interp and x.dtype == torch.bfloat16),
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return dst


__all__ = ["default_config", "w8a16_matmul", "w8a16_matmul_ref"]
