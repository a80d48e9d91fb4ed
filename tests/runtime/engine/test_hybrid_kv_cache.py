"""The hybrid KV layout (kv_cache/layout.py) and its block tables (HybridKVCacheManager).

A model mixing sliding-window and full-attention layers gets block tables per kind of layer
on one shared pool of pages: the windowed tables give back what falls behind the window, so
a long request holds its full layers' pages and a window's worth for the others. Pure
bookkeeping here; test_gemma2.py / test_gemma3.py run the models on it against transformers.
"""

from __future__ import annotations

import pytest
from argosy_runtime.kv_cache import (
    HybridKVCacheManager,
    KVCacheManager,
    kv_cache_layout,
    make_kv_cache_manager,
    single_table_layout,
)

NULL = 0  # the shared pool's null block


def gemma3_windows(num_layers: int, window: int = 1024) -> list[int | None]:
    return [None if i % 6 == 5 else window for i in range(num_layers)]


def test_gemma3_layout_pages_of_four_layers_seven_tables() -> None:
    """gemma-3-1b: 26 layers, every 6th full (4 full, 22 windowed). Pages of 4 layers: one
    full table, 6 windowed ones (24 slots for 22 layers: 2 padding, within 10%)."""
    layout = kv_cache_layout(gemma3_windows(26), 26, 32768)
    assert layout.page_layers == 4 and layout.is_hybrid
    assert layout.table_windows == (None,) + (1024,) * 6
    full = [i for i in range(26) if i % 6 == 5]
    assert [layout.layer_tables[i] for i in full] == [0, 0, 0, 0]
    assert [layout.layer_slots[i] for i in full] == [0, 1, 2, 3]
    windowed = [i for i in range(26) if i % 6 != 5]
    assert [layout.layer_tables[i] for i in windowed] == [1 + j // 4 for j in range(22)]
    # No two layers share a (table, slot): each has its own K/V.
    assert len(set(zip(layout.layer_tables, layout.layer_slots))) == 26


def test_other_layouts() -> None:
    # Gemma 2: alternating, 13 of each: pages of 13 layers, two tables, no padding.
    gemma2 = kv_cache_layout([4096 if i % 2 == 0 else None for i in range(26)], 26, 8192)
    assert (gemma2.page_layers, gemma2.table_windows) == (13, (None, 4096))
    # Qwen2 with max_window_layers 21 of 28: 21 full, 7 windowed; pages of 7 (no padding)
    # beat pages of 21 (14 padding).
    qwen2 = kv_cache_layout([None] * 21 + [32768] * 7, 28, 131072)
    assert (qwen2.page_layers, qwen2.table_windows) == (7, (None, None, None, 32768))
    # One window for all (Mistral): one table, which releases blocks itself.
    assert kv_cache_layout([4096] * 32, 32, 32768) == single_table_layout(32, 4096)
    assert kv_cache_layout((), 12, 2048) == single_table_layout(12)
    # Windows no shorter than the context hide nothing: one full table.
    assert kv_cache_layout(gemma3_windows(26), 26, 1024) == single_table_layout(26)
    # Two windows and no full layer: a table per window, the shorter one first.
    both = kv_cache_layout([8, 16, 8, 16], 4, 64)
    assert both.table_windows == (8, 16) and both.layer_tables == (0, 1, 0, 1)
    assert isinstance(make_kv_cache_manager(8, 4, True, single_table_layout(2)), KVCacheManager)
    assert isinstance(make_kv_cache_manager(8, 4, True, both), HybridKVCacheManager)


def hybrid(num_blocks: int, window: int = 4, caching: bool = True) -> HybridKVCacheManager:
    """One full table and one with `window`, block_size 4."""
    return HybridKVCacheManager(num_blocks, 4, caching, (None, window))


def check_refs(kv: HybridKVCacheManager) -> None:
    """Every pool block is referenced exactly as often as table entries name it: no page is
    in two places unless shared on purpose (a prefix hit), none leaked or double-freed."""
    counts: dict[int, int] = {}
    for table in kv.tables:
        for blocks in table.req_to_blocks.values():
            for b in blocks:
                if b.block_id != NULL:
                    counts[b.block_id] = counts.get(b.block_id, 0) + 1
    for block in kv.pool.blocks[1:]:
        assert block.ref_cnt == counts.get(block.block_id, 0), block
    assert kv.num_free_blocks == kv.num_blocks - len(counts)


def test_a_long_request_holds_its_full_table_and_a_window() -> None:
    """Decoding token by token to 40 tokens (10 blocks): the full table holds all 10, the
    windowed one (W = 4) at most 2 live blocks, the rest its null entries; both tables
    stay the same length. Freed, everything is back."""
    kv = hybrid(32)
    tokens = list(range(100, 140))
    assert kv.allocate_slots("a", tokens, 1)
    for c in range(1, 40):
        assert kv.allocate_slots("a", tokens, c + 1, num_computed_tokens=c)
        full, windowed = kv.block_ids("a")
        assert len(full) == len(windowed) == -(-(c + 1) // 4)
        assert NULL not in full and len([b for b in windowed if b != NULL]) <= 2
        check_refs(kv)
    assert kv.max_blocks_held(40, 1) == 10 + 2
    kv.free("a")
    check_refs(kv)
    assert kv.num_free_blocks == kv.num_blocks == 31 and kv.req_to_blocks == {}


def test_allocation_is_all_tables_or_nothing() -> None:
    """A pool that fits the full table's blocks but not the windowed one's as well: refused,
    nothing taken from either table."""
    kv = hybrid(9)  # 8 usable
    assert not kv.can_allocate("a", 20)  # 5 + 5 blocks
    assert not kv.allocate_slots("a", list(range(20)), 20)
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == [[], []]
    assert kv.allocate_slots("a", list(range(16)), 16)  # 4 + 4
    check_refs(kv)
    # Computed up to 16, the windowed table gives back blocks 0-2 (keys from 13 are read):
    # room for the next block in both tables (2 of 3), not the next two (4).
    assert not kv.can_allocate("a", 24, num_computed_tokens=16)
    assert kv.allocate_slots("a", list(range(20)), 20, num_computed_tokens=16)
    check_refs(kv)
    assert [len(t) for t in kv.block_ids("a")] == [5, 5] and kv.num_free_blocks == 1


def test_a_hit_at_the_front_of_the_free_queue_is_not_taken_by_another_table() -> None:
    """Regression: request a's prefix (12 tokens) is cached, a freed. b's hit includes the
    windowed table's block 2, which sits first in the free queue (the least recently
    freed), and the full table needs a new block. Had the full table allocated before the
    windowed one took its hit, its new block would have been that very page: two tables
    writing one page (seen as wrong logprobs in test_gemma3's preemption test)."""
    kv = hybrid(7)  # 6 usable: 3 + 3 for a's 12 tokens
    prefix = list(range(200, 212))
    assert kv.allocate_slots("a", prefix, 12)
    assert kv.allocate_slots("a", prefix, 12, num_computed_tokens=12)  # releases windowed 0-1
    window_hit = kv.tables[1].req_to_blocks["a"][2]
    kv.free("a")
    kv.pool._free.move_to_end(window_hit.block_id, last=False)  # noqa: SLF001 (LRU order)
    tokens = prefix + [300, 301, 302, 303]
    hits = kv.get_computed_blocks("b", tokens)
    assert len(hits) == 3 and hits[2][1] is window_hit
    assert [h[1].block_id for h in hits[:2]] == [NULL, NULL]  # behind the window: not needed
    assert kv.allocate_slots("b", tokens, 16, hits, num_computed_tokens=12)
    check_refs(kv)
    full, windowed = kv.block_ids("b")
    assert windowed[2] == window_hit.block_id and window_hit.block_id not in full


def test_a_hit_needs_every_table() -> None:
    """a's 16 tokens (4 blocks) cached in both tables, then the windowed table's block 3
    evicted. b (the same 16 tokens + 4): the full table alone would hit 4 blocks, but
    computing from 16 needs windowed block 3 (W = 5: keys from 12). From 12 it needs
    windowed block 2 only (keys from 8): the hit is 3 blocks."""
    kv = hybrid(16, window=5)
    tokens = list(range(16))
    assert kv.allocate_slots("a", tokens, 16)
    full_a, windowed_a = ([b.block_id for b in t.req_to_blocks["a"]] for t in kv.tables)
    kv.free("a")
    kv.pool.uncache_block(kv.pool.blocks[windowed_a[3]])
    hits = kv.get_computed_blocks("b", tokens + [1, 2, 3, 4])
    assert [h[0].block_id for h in hits] == full_a[:3]
    assert [h[1].block_id for h in hits] == [NULL, NULL, windowed_a[2]]
    assert kv.allocate_slots("b", tokens + [1, 2, 3, 4], 20, hits, num_computed_tokens=12)
    check_refs(kv)


def test_preemption_accounting_sums_the_tables() -> None:
    kv = hybrid(20)
    assert kv.allocate_slots("a", list(range(12)), 12)
    assert kv.allocate_slots("b", list(range(50, 58)), 8)
    assert kv.num_blocks_freed_by(["a"]) == 6 and kv.num_blocks_freed_by(["a", "b"]) == 10
    assert kv.num_free_blocks == 9
    assert not kv.can_allocate("c", 24)  # 6 + 6 blocks
    assert kv.can_allocate("c", 24, extra_free=kv.num_blocks_freed_by(["b"]))
    kv.unhash_step_blocks("a")
    kv.free("a")
    kv.free("b")
    check_refs(kv)
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_truncate_and_abort_return_every_block(caching: bool) -> None:
    kv = hybrid(24, caching=caching)
    tokens = list(range(30))
    assert kv.allocate_slots("a", tokens[:10], 10)
    assert kv.allocate_slots("a", tokens[:10], 18, num_computed_tokens=10)  # drafts
    kv.truncate("a", 13)  # rejected drafts roll back
    assert [len(t) for t in kv.block_ids("a")] == [4, 4]
    check_refs(kv)
    kv.free("a")
    check_refs(kv)
    assert kv.num_free_blocks == kv.num_blocks
