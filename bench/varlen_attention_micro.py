"""Decode rows through cpu_ops.varlen_attention (the batch-invariant mode's attention) against
the default decode kernel, per layer, SmolLM2-135M's heads (9 query, 3 kv, dim 64), bf16.

    python bench/varlen_attention_micro.py
"""

from __future__ import annotations

import time

import torch
from argosy_kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(1, 256), (8, 256), (32, 256), (32, 1024), (1, 4000)]  # (sequences, context)


def median_us(op, *args, repeats: int = 15) -> float:
    for _ in range(3):
        op(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e6


def main() -> None:
    if not cpu_ops.has_avx512_bf16():
        raise SystemExit("needs the fused CPU kernels with AVX512-BF16")
    torch.manual_seed(0)
    print("sequences x context | decode kernel us | varlen us | ratio")
    for seqs, context in CASES:
        blocks_per_seq = -(-context // BLOCK)
        key_cache = torch.randn(seqs * blocks_per_seq, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
        value_cache = torch.randn_like(key_cache)
        tables = torch.arange(seqs * blocks_per_seq, dtype=torch.int32).view(seqs, -1)
        query = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()
        lens = torch.full((seqs,), context, dtype=torch.int32)
        starts = torch.arange(seqs + 1, dtype=torch.int32)
        scale = HEAD_DIM**-0.5
        caches = (query, key_cache, value_cache, tables)
        decode = median_us(cpu_ops.decode_attention, *caches, lens, scale)
        varlen = median_us(cpu_ops.varlen_attention, *caches, starts, lens, scale)
        print(f"{seqs} x {context} | {decode:.0f} | {varlen:.0f} | {varlen / decode:.1f}x")


if __name__ == "__main__":
    main()
