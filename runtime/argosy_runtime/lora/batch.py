"""`LoRABatch`: which rows of one step's flattened batch use which adapter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops

from argosy_runtime.lora.adapter import LoRAAdapter

_NO_ROWS = torch.empty(0, dtype=torch.long)  # lora_add: every row


class LoRABatch:
    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]],
                 batch_invariant: bool = False) -> None:
        self.groups = groups  # (adapter, row indices [n] int64), one entry per adapter
        # lora_add's fused pass serves up to 16 rows by default; the batch-invariant mode takes
        # it for every row count (-1), since a row's result there depends on no other row.
        self._fused_max_rows = (-1,) if batch_invariant else ()

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """out[rows] += (x[rows] A^T) B^T * scale for each adapter's rows, in place; rows of
        the base model and projections an adapter leaves alone are untouched. Same op order
        as PEFT (B after A, then the scale), so float32 results match it. bfloat16 on the CPU
        goes through cpu_ops' lora_add, which the C++ decode layer calls too: the two paths
        agree exactly, and decode-sized batches take its fused kernel."""
        fused = out.dtype == torch.bfloat16 and out.is_cpu and cpu_ops.available()
        for adapter, rows in self.groups:
            weights = adapter.layers.get(layer, {}).get(module)
            if weights is None:
                continue
            every_row = rows.numel() == x.shape[0]  # no gather/scatter needed
            if fused:
                torch.ops.argosy_cpu.lora_add(out, x, _NO_ROWS if every_row else rows,
                                              weights.a, weights.b, adapter.scale,
                                              *self._fused_max_rows)
            elif every_row:
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
