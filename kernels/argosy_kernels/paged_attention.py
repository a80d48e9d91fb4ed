"""Decode attention over a paged KV cache.

Cache layout (shared by the torch and Triton paths, fixed in DESIGN.md):
  key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A sequence's token t lives in block block_tables[s, t // block_size] at row t % block_size.
"""

from __future__ import annotations

import torch


def paged_decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs], the current token included
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence against all of its cached tokens (pure torch).

    Gathers each sequence's blocks into a dense [num_seqs, max_len] view, then does masked
    softmax attention in float32. GQA: query head h reads kv head h // (num_heads // num_kv_heads).
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    # [num_seqs, max_len, num_kv_heads, head_dim]
    keys = key_cache[blocks].flatten(1, 2)[:, :max_len].float()
    values = value_cache[blocks].flatten(1, 2)[:, :max_len].float()
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", q, keys) * scale  # [s, kvh, group, max_len]
    positions = torch.arange(max_len, device=query.device)
    pad = positions[None, :] >= context_lens[:, None].long()  # [num_seqs, max_len]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgt,stkd->skgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
