"""The LoRA delta of one SmolLM2 layer (its four projections, rank 16 on every module): the
fused `cpu_ops.lora_add` against the PyTorch ops it replaces, at 1 and 8 rows.

    python bench/lora_delta_micro.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops

# (in features, stacked rank, out features) of qkv, o, gate_up and down with rank 16.
SHAPES = [(576, 48, 960), (576, 16, 576), (576, 32, 3072), (1536, 16, 576)]


def microseconds(fn: Callable[[], object], reps: int = 300) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    assert cpu_ops.available(), "cpu_ops did not build"
    torch.manual_seed(0)
    every_row = torch.empty(0, dtype=torch.long)
    for rows in (1, 8):
        fused_total = torch_total = 0.0
        for fan_in, rank, fan_out in SHAPES:
            x = torch.randn(rows, fan_in).bfloat16()
            a = (torch.randn(rank, fan_in) * 0.05).bfloat16()
            b = (torch.randn(fan_out, rank) * 0.05).bfloat16()
            out = torch.randn(rows, fan_out).bfloat16()
            fused = microseconds(
                lambda x=x, a=a, b=b, out=out: torch.ops.argosy_cpu.lora_add(
                    out, x, every_row, a, b, 2.0))
            eager = microseconds(
                lambda x=x, a=a, b=b, out=out: out.add_(F.linear(F.linear(x, a), b) * 2.0))
            fused_total, torch_total = fused_total + fused, torch_total + eager
            print(f"rows {rows} {fan_in}x{rank}x{fan_out}: fused {fused:.1f} us, "
                  f"torch {eager:.1f} us")
        print(f"rows {rows}: per layer fused {fused_total:.0f} us, torch {torch_total:.0f} us; "
              f"x30 layers: {fused_total * 30 / 1e3:.1f} vs {torch_total * 30 / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
