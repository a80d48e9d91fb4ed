"""Paged KV cache bookkeeping: the block pool and the per-request block tables (pure Python)."""

from argosy_runtime.kv_cache.block_pool import BlockPool, KVCacheBlock
from argosy_runtime.kv_cache.hybrid_kv_cache_manager import HybridKVCacheManager
from argosy_runtime.kv_cache.kv_cache_manager import KVCacheManager, hash_block_tokens
from argosy_runtime.kv_cache.layout import KVCacheLayout, kv_cache_layout, single_table_layout

__all__ = ["BlockPool", "HybridKVCacheManager", "KVCacheBlock", "KVCacheLayout", "KVCacheManager",
           "hash_block_tokens", "kv_cache_layout", "make_kv_cache_manager", "single_table_layout"]


def make_kv_cache_manager(num_blocks: int, block_size: int, enable_caching: bool,
                          layout: KVCacheLayout) -> KVCacheManager | HybridKVCacheManager:
    """The manager of the layout's block tables: one KVCacheManager for a single table."""
    if layout.is_hybrid:
        return HybridKVCacheManager(num_blocks, block_size, enable_caching, layout.table_windows)
    return KVCacheManager(num_blocks, block_size, enable_caching, layout.table_windows[0])
