"""A separate draft model's KV cache: blocks of its own, laid out for the draft's layers.

A separate draft (spec_decode/draft_proposer.py) reads and writes only its own K/V, so its
block ids need not be the target's. It has a KV manager of its own, without prefix caching (a
draft catches up from position 0 when it meets a request), in the layout of its own layers
(kv_cache/layout.py). So it works beside any target layout, the hybrid one included, and a
Gemma draft's windowed layers give back their pages behind the window just as the target's
do (the proposer catches up in chunks of the target's step, so they can).

Its pool is sized to hold what the target's holds: a block of a sequence takes a page in each
table while the sequence is short, and in the full-attention tables only once the windowed
ones release theirs, so the draft gets the larger of the two ratios of its pages per target
page (`draft_pages_per_target_page`): one for a draft laid out like its target (a quantized
copy), 7/5 for gemma-3-1b (7 tables) beside gemma-3-27b (5). Requests that share a prefix in
the target's cache still hold a copy each here, so the draft may run short where the target
does not; a request then goes undrafted for a step (`DraftProposer` first frees the K/V of
requests that are not drafting, if that makes room). Exactness never depends on it.

The engine counts the draft's pages in the KV budget (`draft_cache_bytes_per_target_page`),
loading the draft before it measures the memory left, so --kv-cache-memory and the GPU memory
fraction cover both caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from argosy_runtime.kv_cache import KVCacheLayout, kv_cache_layout, make_kv_cache_manager
from argosy_runtime.model_runner import kv_cache_bytes_per_block
from argosy_runtime.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from argosy_runtime.model_loader import ModelSpec
    from argosy_runtime.spec_decode.config import SpeculativeConfig


def draft_num_layers(model: LlamaForCausalLM, config: SpeculativeConfig) -> int:
    """The layers of a separate draft that run: `draft_layers`, or all of them."""
    n = config.draft_layers or model.spec.num_hidden_layers
    if n > model.spec.num_hidden_layers:
        raise ValueError(f"draft_layers ({n}) exceeds the draft's "
                         f"{model.spec.num_hidden_layers} layers")
    return n


def draft_max_positions(spec: ModelSpec, max_model_len: int) -> int:
    """The positions a separate draft runs: the target's, as far as its rotary reaches."""
    return min(max_model_len, spec.max_position_embeddings)


def draft_cache_layout(model: LlamaForCausalLM, config: SpeculativeConfig,
                       max_model_len: int) -> KVCacheLayout:
    """The layout of the layers the draft runs."""
    num_layers = draft_num_layers(model, config)
    return kv_cache_layout(model.spec.layer_sliding_windows[:num_layers], num_layers,
                           draft_max_positions(model.spec, max_model_len))


def draft_pages_per_target_page(target: KVCacheLayout, draft: KVCacheLayout) -> float:
    """Draft pages per target page, so that the draft has room for what the target holds
    (see the module doc): per block of a sequence, pages in every table while it is short,
    in the full-attention tables only once it is past the windows."""
    ratio = draft.num_tables / target.num_tables
    target_full = target.table_windows.count(None)
    if target_full:
        ratio = max(ratio, draft.table_windows.count(None) / target_full)
    return ratio


def draft_cache_bytes_per_target_page(model: LlamaForCausalLM, config: SpeculativeConfig,
                                      max_model_len: int, target: KVCacheLayout,
                                      block_size: int, dtype: torch.dtype) -> float:
    """The draft cache's memory per page of the target's, for the engine's KV budget."""
    layout = draft_cache_layout(model, config, max_model_len)
    return (draft_pages_per_target_page(target, layout)
            * kv_cache_bytes_per_block(model, block_size, dtype, layout.page_layers))


class DraftCache:
    """The draft's K/V pages (`kv_caches`, one (K, V) per layer it runs) and the manager of
    their block tables, whose block ids `build_batch` takes like the target's."""

    def __init__(self, model: LlamaForCausalLM, config: SpeculativeConfig, max_model_len: int,
                 target: KVCacheLayout, target_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        spec = model.spec
        layout = draft_cache_layout(model, config, max_model_len)
        self.layout = layout
        # Rounded down: the engine's budget counted the exact share.
        num_blocks = max(1, int(target_blocks * draft_pages_per_target_page(target, layout)))
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

    def could_allocate(self, request_id: str, num_tokens: int, first_new_position: int,
                       freeing: Sequence[str]) -> bool:
        """Would `allocate` succeed once the requests `freeing` were freed?"""
        return self.manager.can_allocate(
            request_id, num_tokens, extra_free=self.manager.num_blocks_freed_by(freeing),
            num_computed_tokens=first_new_position)

    def block_ids(self, request_id: str) -> Sequence:
        """[blocks], or [tables, blocks] on a hybrid layout."""
        return self.manager.block_ids(request_id)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)
