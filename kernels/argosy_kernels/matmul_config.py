"""Launch parameters of the quantized matmul kernels (w8a16_matmul, w4a16_matmul).

Each launcher picks a config from M (the rows of x) on its own; tests and the GPU tuning script
(bench/gpu_matmul_tune.py) pass one to reach every path. Two inner products:
- tensor cores (`use_dot`): a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] `tl.dot`, whose M is at
  least 16: the right choice once a batch has a dozen rows or more;
- FMA (`use_dot=False`): each launcher's one-row kernel (one warp and one row of x per
  program, block_m and num_warps do not apply), multiply and sum in float32 registers. A
  decode step's M is the batch size; at M = 1 a dot would compute 15 padding rows and stage
  every dequantized weight tile through shared memory for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from argosy_kernels._triton import num_sms


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int  # K elements per tile (w8a16), or packed int32 words, 8 K each (w4a16)
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    # K splits (partial sums in float32, added afterwards); None: enough to give every SM two
    # programs when the M x N tiles alone would not.
    split_k: int | None = None


def choose_split_k(config: MatmulConfig, programs: int, k_len: int, tile: int,
                   device: torch.device, min_blocks_per_split: int) -> tuple[int, int]:
    """(splits, K per split: a multiple of `tile`) for a launch of `programs` M x N tiles
    over `k_len` of K (elements, or int32 words for w4a16). config.split_k, or the automatic
    choice: small-M launches of a few N tiles otherwise leave most SMs idle while each program
    walks all of K; the rule splits only below two programs per SM, since a split costs a
    float32 buffer and two more launches (sum, copy) per matmul in every decode step. Each
    split keeps at least `min_blocks_per_split` K tiles, so a program still has a loop to
    pipeline."""
    k_blocks = -(-k_len // tile)
    target = 2 * num_sms(device)
    if config.split_k is not None:
        split_k = max(1, config.split_k)
    elif programs >= target:
        split_k = 1
    else:
        split_k = max(1, min(-(-target // programs), k_blocks // min_blocks_per_split, 16))
    per_split = -(-k_blocks // split_k) * tile
    return -(-k_len // per_split), per_split


def split_k_buffer(out: torch.Tensor, split_k: int) -> torch.Tensor:
    """Where a matmul kernel writes: `out`, or float32 partial sums [split_k, M, N] that the
    launcher adds into `out` afterwards."""
    if split_k == 1:
        return out
    return torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device)
