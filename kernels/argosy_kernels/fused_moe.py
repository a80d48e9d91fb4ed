"""Mixture-of-Experts MLP as two grouped GEMMs over every expert at once (the GPU path of
`models/moe.py`'s SparseMoeBlock).

Each token goes to top_k experts; a (token, slot) pair is one row of work. The module path
loops over the experts, one small GEMM per expert with its tokens gathered: on a GPU that is
num_experts launches per layer (mostly tiny) plus a host read of the group sizes per layer,
which also rules out CUDA graphs. Here:

1. `align_pairs_by_expert` sorts the pairs by expert and pads each expert's group to a
   multiple of BLOCK_M (pad entries hold the invalid pair id num_pairs), so every BLOCK_M rows
   of the sorted list belong to one expert. Pure torch, no host read: the list is sized for
   the worst case and the kernel's programs past the real end return at once.
2. `_fused_moe_gemm_kernel` computes, for each block of sorted pairs, x[token] @ W[expert]^T
   (GEMM 1: x [tokens, H] by the experts' fused gate_up [E, 2I, H]; GEMM 2: the activations
   [pairs, I] by down [E, H, I], each row scaled by its routing weight), storing row by pair.
3. SiLU x up between them (silu_and_mul.py), and the top_k rows of each token summed.

Weights are the experts' nn.Linear weights stacked ([out, in] each, as the module keeps them);
math in float32 (tensor cores, "ieee" for float32 inputs so float32 stays exact to rounding),
rounded to the activations' dtype after each GEMM, as the module path rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from argosy_kernels._triton import check_device, interpret_mode, triton_jit
from argosy_kernels.silu_and_mul import silu_and_mul

if TYPE_CHECKING:
    import triton.language as tl


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Pure torch, expert by expert: x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2
    [E, H, I], topk_weights / topk_ids [T, top_k] -> [T, H] in x's dtype. Each pair's output
    is weight * down(silu(gate) * up) in float32; the sum over a token's pairs is rounded
    once."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens].float() @ w13[e].float().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = act @ w2[e].float().T
        out.index_add_(0, tokens, down * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(x.dtype)


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs [L] int32, block_experts [L / block_m] int32, num_padded [1] int32) for
    topk_ids [T, top_k]: the pair ids (t * top_k + slot) grouped by expert, each group padded
    with the invalid id T * top_k to a multiple of block_m; the expert of each block of
    block_m entries; the real length of the padded list. L is the worst case (every expert
    present ends in a partial block), so nothing here waits for the device (graph safe)."""
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    device = flat.device
    # bincount would read the largest id on the host; scatter_add does not.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank_in_group = (torch.arange(pairs, device=device)
                     - (torch.cumsum(counts, 0) - counts)[expert_of_sorted])
    length = pairs + min(num_experts, pairs) * (block_m - 1)
    length = -(-length // block_m) * block_m
    sorted_pairs = torch.full((length,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[(group_end - padded)[expert_of_sorted] + rank_in_group] = order.to(torch.int32)
    block_starts = torch.arange(0, length, block_m, device=device)
    # Blocks past the end get expert num_experts - 1: never read, their programs return first.
    block_experts = torch.searchsorted(group_end, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_experts, group_end[-1:].to(torch.int32)


@triton_jit
def _fused_moe_gemm_kernel(
    a_ptr,  # [T, K] read at row pair // ROWS_PER_A (GEMM 1: ROWS_PER_A = top_k; GEMM 2: 1)
    w_ptr,  # [E, N, K]
    c_ptr,  # [pairs, N]
    weights_ptr,  # [pairs] routing weights, read when MUL_WEIGHTS
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    ROWS_PER_A: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # bf16 under the interpreter, whose bf16 dot is wrong
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    row = pair // ROWS_PER_A
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = a_ptr + row[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PREC)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows_per_a: int,
                  aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_m: int,
                  weights: torch.Tensor | None = None) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n, k = w.shape[1], w.shape[2]
    interp = interpret_mode()
    block_n, block_k = (32, 32) if interp else (64, 64)
    grid = (block_experts.numel(), -(-n // block_n))
    _fused_moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_pairs, block_experts,
        num_padded, out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, MUL_WEIGHTS=weights is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST_DOT=interp and a.dtype == torch.bfloat16,
        DOT_PREC="ieee" if a.dtype == torch.float32 or interp else "tf32", num_warps=4)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton MoE MLP; same contract as `fused_moe_ref` (written into `out` if given). The
    weight tensors must be contiguous in their last dimension (the experts' nn.Linear weights
    stacked)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [tokens, hidden], w13 [experts, 2 * inter, hidden] and w2 "
                         f"[experts, hidden, inter]; got {tuple(x.shape)}, {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    experts, hidden, inter = w2.shape
    if w13.shape != (experts, 2 * inter, hidden) or x.shape[1] != hidden:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError("topk_weights and topk_ids must both be [tokens, top_k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:  # tl.dot needs one dtype on both sides
        raise ValueError(f"w13 and w2 must be in x's dtype {x.dtype}, got {w13.dtype} and "
                         f"{w2.dtype}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("w13 and w2 must be contiguous in their last dimension")
    check_device(x)
    tokens, top_k = topk_ids.shape
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError("out must have x's shape and dtype")
    if tokens == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    pairs = tokens * top_k
    # 16 rows (the smallest tensor-core tile) while most experts get a handful of pairs.
    block_m = 16 if pairs <= 16 * experts else 64
    aligned = align_pairs_by_expert(topk_ids, experts, block_m)
    gate_up = torch.empty(pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, top_k, aligned, block_m)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(silu_and_mul(gate_up), w2, down, 1, aligned, block_m,
                  weights=topk_weights.flatten().contiguous())
    return torch.sum(down.view(tokens, top_k, hidden), dim=1, out=out)


__all__ = ["align_pairs_by_expert", "fused_moe", "fused_moe_ref"]
