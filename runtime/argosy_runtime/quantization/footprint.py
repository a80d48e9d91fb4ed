"""Memory footprint helpers: bytes of a model's weights (quantized buffers included)."""

from __future__ import annotations

import torch
from torch import nn


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (tied ones once) plus the quantized layers' buffers
    (qweight, scales, zeros, bias, input permutation) and oneDNN-packed weights: the bytes the
    weights occupy in memory, so a tied lm_head packed as its own copy counts twice. Other
    buffers (rotary tables) are not weights and are left out."""
    from argosy_runtime.models.cpu_linear import PackedLinear
    from argosy_runtime.quantization.int4_linear import Int4Linear
    from argosy_runtime.quantization.int8_linear import Int8Linear

    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear):
            for b in module.buffers(recurse=False):
                add(b)
        elif isinstance(module, PackedLinear):  # oneDNN-packed bf16 weights are not parameters
            total += module.weight_nbytes
            add(module.bias)
    return total
