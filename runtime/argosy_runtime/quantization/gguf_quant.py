"""GGUF blocks kept quantized: Q4_1 / Q4_0 -> int4 group 32 exactly; Q8_0 parsed in torch.

Block layouts (ggml), 32 weights per block along each row:
- Q4_0: fp16 d, 16 bytes of nibbles; w = (q - 8) * d.
- Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = q * d + m.
- Q8_0: fp16 d, 32 int8; w = q * d.
Nibbles: byte j holds weight j (low) and weight j + 16 (high).
Q4_x map onto our int4 group-32 form with s = d and z = m + 8 d (Q4_1) or z = 0 (Q4_0).
Q8_0 has one scale per 32 weights, which per-channel int8 cannot hold, so it is dequantized
(here, in torch) and re-quantized by the caller.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor

from argosy_runtime.quantization.rtn import Int4Weight

GGUF_BLOCK = 32
INT4_GGUF_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def _blocks(tensor: ReaderTensor, block_bytes: int) -> tuple[torch.Tensor, int, int]:
    """Raw bytes as uint8 [N, K / 32, block_bytes], plus N and K (HF [out, in] shape)."""
    k, n = (int(d) for d in tensor.shape.tolist()[:2])
    if k % GGUF_BLOCK:
        raise ValueError(f"GGUF tensor {tensor.name}: row length {k} is not a multiple of 32")
    data = torch.from_numpy(np.array(tensor.data, copy=True).view(np.uint8))  # writable copy
    return data.reshape(n, k // GGUF_BLOCK, block_bytes), n, k


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian halves -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, nb, 16] -> uint8 [N, nb * 32]: byte j -> weights j (low), j + 16 (high)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(qs.shape[0], -1)


def q4_to_int4(tensor: ReaderTensor) -> Int4Weight:
    """A Q4_0/Q4_1 tensor as int4 group 32, bit-exact (rows in file order)."""
    if tensor.tensor_type == GGMLQuantizationType.Q4_1:
        blocks, n, k = _blocks(tensor, 20)
        d, m = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [N, nb]
        q = _nibbles(blocks[..., 4:20])
        zeros = m + 8 * d
    elif tensor.tensor_type == GGMLQuantizationType.Q4_0:
        blocks, n, k = _blocks(tensor, 18)
        d = _fp16(blocks[..., 0:2])
        q = _nibbles(blocks[..., 2:18])
        zeros = torch.zeros_like(d)
    else:
        raise ValueError(f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, not Q4_0/Q4_1")
    return Int4Weight(q, d, zeros, GGUF_BLOCK, k)


def q8_0_dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """A Q8_0 tensor as float32 [N, K] (rows in file order)."""
    if tensor.tensor_type != GGMLQuantizationType.Q8_0:
        raise ValueError(f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, not Q8_0")
    blocks, n, k = _blocks(tensor, 34)
    d = _fp16(blocks[..., 0:2])  # [N, nb]
    qs = blocks[..., 2:34].contiguous().view(torch.int8).float()  # [N, nb, 32]
    return (qs * d[..., None]).reshape(n, k)


def permute_rows(weight: Int4Weight, rows: torch.Tensor) -> Int4Weight:
    """The same weight with output rows reordered: row i of the result is row rows[i]."""
    return Int4Weight(weight.q[rows], weight.scales[rows], weight.zeros[rows],
                      weight.group_size, weight.in_features, weight.input_perm)
