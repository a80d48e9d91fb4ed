"""`Int8Embedding`: token embeddings read from a tied, int8-quantized lm_head.

Small models tie the embedding to the output projection (SmolLM2: one 49152 x 576 matrix,
56 MB in bfloat16, a quarter of the 135M model's weight bytes). In the quantized modes the
lm_head is an `Int8Linear`, and the embedding looks its rows up in that same int8 table, so
the model keeps one int8 copy of the matrix instead of a bfloat16 table plus a packed copy,
and prompts are embedded with exactly the weights that score the next token.
"""

from __future__ import annotations

import torch
from torch import nn

from argosy_runtime.quantization.int8_linear import Int8Linear


class Int8Embedding(nn.Module):
    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        # Not a registered child: the head belongs to the model as its lm_head, where device
        # moves reach it; registered buffers here would be copied apart from it by `.to()`.
        object.__setattr__(self, "head", head)
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.head.qweight[input_ids]  # [..., hidden] int8
        scales = self.head.scales[input_ids].unsqueeze(-1)
        return rows.to(scales.dtype) * scales

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows of the tied lm_head"
