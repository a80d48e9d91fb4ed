"""Triton attention backend (the CUDA path): same interface as `TorchAttentionBackend`.

Per layer and step:
  1. `reshape_and_cache` writes every new token's K/V (quantizing into an int8 cache when
     scales are passed); padded tokens carry slot -1 and write nothing;
  2. decodes (the first `meta.num_decodes` tokens) go through `paged_decode_attention`;
  3. prompt chunks / multi-token sequences go through `paged_prefill_attention`, reading all
     their keys (cached prefix and this chunk) from the cache.
A sliding-window layer passes `sliding_window=W` (keys p - W < k <= p): both kernels then start
at the window's first key. A soft-capped layer (Gemma 2) passes `softcap=C`: both kernels cap
the scores, C * tanh(s / C), before the mask and softmax.
No step of the decode-only path reads a device value on the host, so a decode step can be
captured in a CUDA graph (see `argosy_runtime.cuda_graph_runner`).
"""

from __future__ import annotations

import torch
from argosy_kernels.paged_attention import paged_decode_attention
from argosy_kernels.paged_prefill_attention import paged_prefill_attention
from argosy_kernels.reshape_and_cache import reshape_and_cache

from argosy_runtime.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention with the argosy_kernels Triton kernels."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as is
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        # All new K/V land before any attention reads (same-step prefix-cache hits).
        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, **scales)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                query[:nd], key_cache, value_cache, meta.decode_block_tables,
                meta.decode_context_lens, self.scale, out=out[:nd], sliding_window=sliding_window,
                softcap=softcap, **scales,
            )
        if meta.num_prefills:
            qsl, seq_lens = meta.prefill_query_start_loc, meta.prefill_seq_lens_t
            if qsl is None or seq_lens is None:
                dev = query.device
                qsl = torch.tensor([0, *_cumsum(meta.prefill_query_lens)], dtype=torch.int32,
                                   device=dev)
                seq_lens = torch.tensor(meta.prefill_seq_lens, dtype=torch.int32, device=dev)
            paged_prefill_attention(
                query[nd:], key_cache, value_cache, meta.prefill_block_tables, qsl, seq_lens,
                self.scale, out=out[nd:], max_query_len=max(meta.prefill_query_lens),
                sliding_window=sliding_window, softcap=softcap, **scales,
            )
        return out


def _cumsum(xs: list[int]) -> list[int]:
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out
