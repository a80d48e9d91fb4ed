"""One prompt through a built model as the model runner runs it: a flattened batch over a
zeroed paged KV cache, the CPU attention backend (shared by the loader tests that compare
hidden states or head logits with transformers)."""

from __future__ import annotations

import numpy as np
import torch
from argosy_runtime.attention import TorchAttentionBackend
from argosy_runtime.attention.batch import build_batch
from argosy_runtime.models.llama import ForwardContext, LlamaForCausalLM

BLOCK_SIZE = 16


def forward_prompt(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """[num_tokens, hidden] final hidden states (after the final norm), in the model's dtype."""
    spec = model.spec
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    ids, positions, meta = build_batch([(np.arange(num_blocks), 0, token_ids)], BLOCK_SIZE,
                                       torch.device("cpu"), model.decode_rows_up_to)
    kv = torch.zeros(spec.num_hidden_layers, 2, num_blocks, BLOCK_SIZE, spec.num_key_value_heads,
                     spec.head_dim, dtype=model.model.norm.weight.dtype)
    backend = TorchAttentionBackend(spec.num_attention_heads, spec.num_key_value_heads,
                                    spec.head_dim, spec.head_dim**-0.5)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(spec.num_hidden_layers)]
    with torch.inference_mode():
        return model(ids, positions, ForwardContext(model.rotary, backend, caches, meta))
