"""oneDNN-prepacked linear layers for bfloat16 on the CPU.

A plain `F.linear` re-reads the weight in its [out, in] layout every call; oneDNN can reorder
it once into its blocked layout. Measured here (AVX-512 BF16, 2 cores): 576x3072 at one token
85 us vs 181 us, at 32 tokens 325 us vs 499 us, with bit-identical outputs. Only bfloat16 on
the CPU is packed: float32 keeps the plain path that matches transformers bit for bit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("argosy.models")

# The batch-size hint oneDNN packs for; 128 was fastest across 1..300 tokens here.
_PACK_HINT = 128


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.weight_nbytes = weight.numel() * weight.element_size()  # for memory reports
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # The batch-invariant mode sets 2: oneDNN computes a single row with another kernel
        # (a GEMV) than 2 or more rows, and the two round some outputs differently; from 2 rows
        # on, a row's result is the same for any row count (tests/runtime/engine/
        # test_batch_invariance.py checks the model's shapes).
        self.min_rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] < self.min_rows:
            padded = torch.cat([x, x.new_zeros(self.min_rows - x.shape[0], x.shape[1])])
            return self.forward(padded)[: x.shape[0]]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Replace every plain bfloat16 nn.Linear on the CPU by a PackedLinear. Returns the count
    (0 where oneDNN is unavailable). Quantized linears are other module types and stay.

    A weight tied to another module (the lm_head of SmolLM2 shares the embedding) is packed
    as its own copy: the embedding still needs the plain rows. That costs vocab x hidden more
    bytes (56 MB for SmolLM2-135M) and makes the lm_head GEMV 2.4x faster (5.9 -> 2.5 ms at
    one token here), the largest single matmul of a small model's decode step.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
    ]
    try:
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
    except RuntimeError as exc:  # an oneDNN build without bf16 support
        logger.warning("oneDNN weight packing unavailable, using plain linears: %s", exc)
        return 0
    return len(targets)
