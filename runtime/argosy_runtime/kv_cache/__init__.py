"""Paged KV cache bookkeeping: the block pool and the per-request block tables (pure Python)."""

from argosy_runtime.kv_cache.block_pool import BlockPool, KVCacheBlock
from argosy_runtime.kv_cache.kv_cache_manager import KVCacheManager, hash_block_tokens

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "hash_block_tokens"]
