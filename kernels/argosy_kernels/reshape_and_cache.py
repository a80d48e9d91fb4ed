"""Write new keys/values into their paged-cache slots."""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int [num_tokens]: block * block_size + offset
) -> None:
    """Scatter each token's K/V into its slot (pure torch)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    slots = slot_mapping.long()
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))
