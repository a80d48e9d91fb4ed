"""`LoRABatch`: which rows of one step's flattened batch use which adapter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from argosy_runtime.lora.adapter import LoRAAdapter


class LoRABatch:
    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]]) -> None:
        self.groups = groups  # (adapter, row indices [n] int64), one entry per adapter

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """out[rows] += each adapted slice's (x[rows] A^T) B^T * scale, in place; rows of
        the base model and modules an adapter leaves alone are untouched. Same op order as
        PEFT (B after A, then the scale), so float32 results match it."""
        for adapter, rows in self.groups:
            slices = adapter.layers.get(layer, {}).get(module)
            if not slices:
                continue
            xs = x.index_select(0, rows)
            for s in slices:
                end = s.offset + s.b.shape[0]
                delta = F.linear(F.linear(xs, s.a), s.b) * s.scale
                out[rows, s.offset : end] += delta
