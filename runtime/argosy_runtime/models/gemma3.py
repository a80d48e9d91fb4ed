"""Gemma 2's and Gemma 3's decoder layer: llama.py's Attention and MLP between four norms.

transformers' Gemma2DecoderLayer / Gemma3DecoderLayer (the same ops), op for op:

    h = h + post_attention_layernorm(self_attn(input_layernorm(h)))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

(Llama adds the attention output to the residual unnormalized and has no norm after the MLP.)
The rest of Gemma 3 is switches on the shared pieces, driven by the spec: RMSNorm scaling by
1 + weight in float32 (`spec.gemma_norms`; the 1 is folded into the weight at load), per-head
q/k norms, attention scale query_pre_attn_scalar ** -0.5, gelu-tanh in the MLP, embeddings
times sqrt(hidden_size), a local rotary table for the sliding-window layers
(`spec.local_rope`), optional final logit soft-capping. Gemma 2 is Gemma 3 without the q/k
norms and the local table, with its attention scores soft-capped (`attn_logit_softcapping`,
which Attention passes to the backend as `softcap`) on every attention path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from argosy_runtime.models.llama import MLP, Attention, ForwardContext, RMSNorm

if TYPE_CHECKING:
    from argosy_runtime.model_loader import ModelSpec


class Gemma3DecoderLayer(nn.Module):
    # cpu_ops.decode_layer implements Llama's layer only (no soft cap either): steps take the
    # module path, whose attention backend soft-caps.
    cpu_decode_layer = False

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx)
        self.mlp = MLP(spec, layer_idx)
        norm = lambda: RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma_norms)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), ctx))
        h, x = self.pre_feedforward_layernorm.add_and_norm(h, attn)
        return h + self.post_feedforward_layernorm(self.mlp(x, ctx.lora))
