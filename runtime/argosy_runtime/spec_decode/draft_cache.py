"""A separate draft model's KV cache: blocks of its own, laid out for the draft's layers.

A separate draft (spec_decode/draft_proposer.py) reads and writes only its own K/V, so its
block ids need not be the target's. It has a KV manager of its own, without prefix caching (a
draft catches up from position 0 when it meets a request), over as many pages as the target's
pool, in the layout of its own layers (kv_cache/layout.py). So it works beside any target
layout, the hybrid one included, and a Gemma draft's windowed layers give back their pages
behind the window just as the target's do. A draft shaped like its target (a quantized copy)
then has room for everything the target holds; requests that share a prefix in the target's
cache hold a copy each here, so the draft may run short where the target does not, and then a
request goes undrafted for a step (`DraftProposer` frees the K/V of requests that are not
drafting, least recently drafted first, before giving up). Exactness never depends on it.

The engine counts the draft's pages in the KV budget (`draft_cache_bytes_per_page`), loading
the draft before it measures the memory left, so --kv-cache-memory and the GPU memory fraction
cover both caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from argosy_runtime.kv_cache import KVCacheLayout, kv_cache_layout, make_kv_cache_manager
from argosy_runtime.model_runner import kv_cache_bytes_per_block
from argosy_runtime.models.llama import LlamaForCausalLM


def draft_cache_layout(model: LlamaForCausalLM, num_layers: int, max_len: int) -> KVCacheLayout:
    """The layout of the draft's first `num_layers` layers (the ones it runs)."""
    windows = model.spec.layer_sliding_windows[:num_layers]
    return kv_cache_layout(windows, num_layers, max_len)


def draft_cache_bytes_per_page(model: LlamaForCausalLM, num_layers: int, max_len: int,
                               block_size: int, dtype: torch.dtype) -> int:
    """What one page of the draft's cache takes: the draft has one per page of the target's."""
    layout = draft_cache_layout(model, num_layers, max_len)
    return kv_cache_bytes_per_block(model, block_size, dtype, layout.page_layers)


class DraftCache:
    """The draft's K/V pages (`kv_caches`, one (K, V) per layer it runs) and the manager of
    their block tables, whose block ids `build_batch` takes like the target's."""

    def __init__(self, model: LlamaForCausalLM, num_layers: int, max_len: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        spec = model.spec
        layout = draft_cache_layout(model, num_layers, max_len)
        self.layout = layout
        self.manager = make_kv_cache_manager(num_blocks, block_size, False, layout)
        # The draft model's own layers read their own tables (ForwardContext.meta_for).
        model.kv_layer_tables = layout.layer_tables if layout.is_hybrid else None
        shape = (layout.page_layers, 2, num_blocks, block_size, spec.num_key_value_heads,
                 spec.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in layout.layer_slots]

    def allocate(self, request_id: str, num_tokens: int, first_new_position: int) -> bool:
        """Blocks for the request's first `num_tokens` positions, the ones behind the draft's
        windows as seen from `first_new_position` given back. False (nothing changed) when the
        pool is short."""
        return self.manager.allocate_slots(request_id, (), num_tokens,
                                           num_computed_tokens=first_new_position)

    def block_ids(self, request_id: str) -> Sequence:
        """[blocks], or [tables, blocks] on a hybrid layout."""
        return self.manager.block_ids(request_id)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)
