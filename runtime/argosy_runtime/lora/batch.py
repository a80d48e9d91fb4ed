"""`LoRABatch`: which rows of one step's flattened batch use which adapter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from argosy_runtime.lora.adapter import LoRAAdapter


class LoRABatch:
    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]]) -> None:
        self.groups = groups  # (adapter, row indices [n] int64), one entry per adapter

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """out[rows] += (x[rows] A^T) B^T * scale for each adapter's rows, in place; rows of
        the base model and projections an adapter leaves alone are untouched. Same op order
        as PEFT (B after A, then the scale), so float32 results match it."""
        for adapter, rows in self.groups:
            weights = adapter.layers.get(layer, {}).get(module)
            if weights is None:
                continue
            if rows.numel() == x.shape[0]:  # every row runs this adapter: no gather/scatter
                out += F.linear(F.linear(x, weights.a), weights.b) * adapter.scale
            else:
                xs = x.index_select(0, rows)
                out.index_add_(0, rows, F.linear(F.linear(xs, weights.a), weights.b)
                               * adapter.scale)

    def decode_layer_args(self, layer: int) -> tuple[list[torch.Tensor], list[float]]:
        """(`lora`, `lora_scales`) of cpu_ops.decode_layer for `layer`: per adapter its rows
        and its (A, B) pairs, which the C++ layer applies as `apply` does."""
        tensors = [t for adapter, rows in self.groups
                   for t in (rows, *adapter.decode_layer_tensors(layer))]
        return tensors, [adapter.scale for adapter, _ in self.groups]
