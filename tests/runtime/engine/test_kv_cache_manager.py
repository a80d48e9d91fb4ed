"""Block pool and KV cache manager: allocation, reference counts, prefix caching, LRU."""

from __future__ import annotations

import pytest
from argosy_runtime.kv_cache import BlockPool, KVCacheManager


def test_allocate_and_free_returns_every_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert kv.allocate_slots("a", tokens, 10)
    assert len(kv.block_ids("a")) == 3  # ceil(10 / 4)
    assert kv.num_free_blocks == 5
    assert kv.usage() == pytest.approx(3 / 8)
    kv.free("a")
    assert kv.num_free_blocks == 8
    assert kv.usage() == 0.0


def test_allocation_fails_without_side_effects_when_pool_is_short() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert not kv.allocate_slots("a", list(range(9)), 9)  # needs 3 blocks
    assert kv.num_free_blocks == 2
    assert kv.block_ids("a") == []


def test_growing_request_gets_blocks_only_at_block_boundaries() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(4))
    assert kv.allocate_slots("a", tokens, 4)
    first = kv.block_ids("a")
    tokens.append(99)
    assert kv.allocate_slots("a", tokens, 5)
    assert kv.block_ids("a")[:1] == first and len(kv.block_ids("a")) == 2
    tokens.extend([100, 101])
    assert kv.allocate_slots("a", tokens, 7)
    assert len(kv.block_ids("a")) == 2


def test_prefix_hits_share_blocks_and_a_lookup_alone_counts_nothing() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert kv.get_computed_blocks("a", prompt) == []
    assert kv.allocate_slots("a", prompt, 13)
    other = prompt[:8] + [500, 501, 502, 503, 504]  # shares the first two blocks only
    hits = kv.get_computed_blocks("b", other)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    # Counted when the scheduler admits a request with its hits (record_prefix_lookup), not
    # per lookup: a blocked head of the queue is looked up again every step.
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.record_prefix_lookup(len(other), len(hits) * kv.block_size)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (13, 8)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots("b", other, 13, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.num_free_blocks == free_before - 2  # only the two private blocks are new
    assert all(b.ref_cnt == 2 for b in hits)


def test_salts_that_pythons_hash_confuses_keep_their_blocks_apart() -> None:
    """Blocks of two LoRA adapters (cache salts) never share, even for salts whose Python
    hash is equal (ints hash modulo 2**61 - 1): block hashes are SHA-256, which no client
    can steer into another's prefix (Python's tuple hash is invertible; vLLM's
    CVE-2025-25183 was such a collision)."""
    salt = 0x1234_5678_9ABC
    other = salt + (2**61 - 1)
    assert hash(salt) == hash(other)  # what the old hash chain was built on
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(13))
    assert kv.allocate_slots("a", prompt, 13, salt=salt)
    assert kv.get_computed_blocks("b", prompt, salt=other) == []
    assert len(kv.get_computed_blocks("c", prompt, salt=salt)) == 3


def test_last_token_is_never_served_from_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    assert kv.allocate_slots("a", prompt, 8)
    kv.free("a")
    hits = kv.get_computed_blocks("b", prompt)
    assert len(hits) == 1  # the final token must be computed to produce logits


def test_cached_free_blocks_count_as_free_and_are_reused_after_release() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    assert kv.allocate_slots("a", prompt, 9)
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.usage() == 0.0
    hits = kv.get_computed_blocks("b", prompt)
    assert len(hits) == 2  # still cached after release
    assert kv.allocate_slots("b", prompt, 9, hits)
    assert kv.num_free_blocks == 1


def test_lru_evicts_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a, b = [1, 2, 3], [7, 8, 9]
    assert kv.allocate_slots("a", a, 3)
    assert kv.allocate_slots("b", b, 3)
    kv.free("a")
    kv.free("b")
    # Two fresh blocks: the uncached partial blocks go first, then a's (freed earlier) cached block.
    assert kv.allocate_slots("c", [20, 21, 22, 23, 24, 25], 6)
    assert kv.get_computed_blocks("b2", b) != []
    assert kv.get_computed_blocks("a2", a) == []


def test_double_free_is_detected() -> None:
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])


def test_truncate_releases_tail_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", list(range(5)), 12)
    assert len(kv.block_ids("a")) == 3
    kv.truncate("a", 5)
    assert len(kv.block_ids("a")) == 2
    assert kv.num_free_blocks == 6


def test_blocks_freed_by_counts_shared_blocks_only_when_every_holder_goes() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(13))  # 4 blocks
    assert kv.allocate_slots("a", prompt, 13)
    other = prompt[:8] + [500, 501, 502, 503, 504]  # shares a's first two blocks; 2 private
    hits = kv.get_computed_blocks("b", other)
    assert kv.allocate_slots("b", other, 13, hits)
    assert kv.num_blocks_freed_by(["a"]) == 2  # its shared two stay with b
    assert kv.num_blocks_freed_by(["b"]) == 2
    assert kv.num_blocks_freed_by(["a", "b"]) == 6
    assert kv.num_blocks_freed_by(["a", "b"], keep=hits) == 4  # hits a newcomer would take
    assert kv.num_blocks_freed_by(["unknown"]) == 0
    free = kv.num_free_blocks
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks - free == 6  # what it predicted
