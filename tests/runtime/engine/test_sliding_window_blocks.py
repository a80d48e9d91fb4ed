"""KV blocks released behind a sliding window (kv_cache/sliding_window.py, KVCacheManager).

When every layer has window W, the blocks wholly before position num_computed_tokens - W + 1
go back to the pool, their table entries become the reserved null block, and a prefix lookup
needs only the blocks the window still reads. Pure bookkeeping: no model."""

from __future__ import annotations

import itertools

import pytest
from argosy_runtime.kv_cache import KVCacheManager
from argosy_runtime.kv_cache.sliding_window import (
    longest_window_hit,
    max_blocks_held,
    num_skipped_blocks,
)

NULL = 0  # the null block's id


def held(kv: KVCacheManager, rid: str) -> list[int]:
    return [b for b in kv.block_ids(rid) if b != NULL]


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 4, 8, 10, 16, 33])
def test_skipped_blocks_are_exactly_those_no_future_query_reads(block_size: int, window: int) -> None:
    """Block j is skipped iff its last position is before the first query's first key."""
    for c in range(0, 5 * window + 3 * block_size):
        first_key = max(0, c - window + 1)  # the query at position c sees keys from here
        expected = sum(1 for j in range(c // block_size + 1) if (j + 1) * block_size <= first_key)
        assert num_skipped_blocks(c, window, block_size) == expected, (c, window, block_size)
    assert num_skipped_blocks(1000, None, block_size) == 0


def test_window_boundary_on_and_off_a_block_edge() -> None:
    """block_size 4. W = 9: at 12 computed tokens the first key is 4, a block edge: block 0
    is released at exactly that step. W = 10: the first key is 3 at 12, 4 at 13."""
    for window, release_at in ((9, 12), (10, 13)):
        kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=window)
        tokens = list(range(100, 140))
        assert kv.allocate_slots("a", tokens, 1)
        for c in range(1, 30):  # one decode per step: c tokens computed, one new
            assert kv.allocate_slots("a", tokens, c + 1, num_computed_tokens=c)
            assert (kv.block_ids("a")[0] == NULL) == (c >= release_at), (window, c)


@pytest.mark.parametrize("block_size,window,chunk", list(itertools.product(
    [1, 2, 4, 8], [3, 4, 8, 10, 12], [1, 3, 4, 7, 16])))
def test_chunked_sequence_holds_only_its_window(block_size: int, window: int, chunk: int) -> None:
    """A sequence computed `chunk` tokens per step: before each step exactly the blocks the
    step's first query can see (and the new ones) are held, the rest are the null block; the
    pool's free count matches; the peak stays within max_blocks_held; all back at the end."""
    kv = KVCacheManager(num_blocks=64, block_size=block_size, sliding_window=window)
    usable = kv.num_blocks
    assert usable == 63 and kv.num_free_blocks == 63
    total = 6 * window + 5
    tokens = list(range(1000, 1000 + total))
    c = peak = 0
    while c < total:
        n = min(chunk, total - c)
        assert kv.allocate_slots("a", tokens, c + n, num_computed_tokens=c)
        table = kv.block_ids("a")
        skip = num_skipped_blocks(c, window, block_size)
        assert table[:skip] == [NULL] * skip
        assert NULL not in table[skip:]
        assert len(table) == -(-(c + n) // block_size)
        assert kv.num_free_blocks == usable - len(table[skip:])
        peak = max(peak, len(table) - skip)
        c += n
    assert peak <= max_blocks_held(total, chunk, window, block_size)
    kv.free("a")
    assert kv.num_free_blocks == usable and kv.usage() == 0.0


def test_shared_blocks_stay_for_their_other_holders() -> None:
    """b takes a's first blocks from the prefix cache; a moving past them drops its
    reference only, so they stay b's until b moves past them too."""
    kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=8)
    prompt = list(range(50, 67))  # 4 full blocks + 1 token
    assert kv.allocate_slots("a", prompt, 17)
    a_blocks = kv.block_ids("a")
    a_block = {b.block_id: b for b in kv.req_to_blocks["a"]}
    hits = kv.get_computed_blocks("b", prompt)
    # b would start at 16, whose query sees keys 9..: blocks 0 and 1 are not needed.
    assert [b.block_id for b in hits] == [NULL, NULL] + a_blocks[2:4]
    assert kv.allocate_slots("b", prompt, 17, hits, num_computed_tokens=16)
    assert kv.block_ids("b")[:4] == [NULL, NULL] + a_blocks[2:4]
    assert [a_block[i].ref_cnt for i in a_blocks[:4]] == [1, 1, 2, 2]
    free = kv.num_free_blocks
    assert kv.allocate_slots("a", prompt, 17, num_computed_tokens=16)  # a releases 0 and 1
    assert kv.num_free_blocks == free + 2
    # At 28 the first key is 21: blocks 2, 3 and 4 go too.
    for c in (17, 21, 25, 28):  # a's chunks: 17-20, 21-24, 25-27, then 28
        assert kv.allocate_slots("a", prompt + [1] * 12, min(c + 4, 28) if c < 28 else 29,
                                 num_computed_tokens=c)
    assert kv.block_ids("a")[:5] == [NULL] * 5
    assert [a_block[i].ref_cnt for i in a_blocks[:4]] == [0, 0, 1, 1]  # 2 and 3 still b's
    assert a_block[a_blocks[4]].ref_cnt == 0  # a's private block 4 came back
    assert kv.num_free_blocks == kv.num_blocks - len(set(held(kv, "a") + held(kv, "b")))
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks


def test_null_block_is_never_handed_out_cached_or_freed() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=2, sliding_window=3)
    tokens = list(range(10, 26))
    for rid in ("a", "b"):  # drain the pool, releasing as they go
        c = 0
        while c < 16 and kv.allocate_slots(rid, tokens, c + 2, num_computed_tokens=c):
            c += 2
    null = kv.pool.null_block
    assert null is not None and null.block_id == NULL
    assert null.ref_cnt == 0 and null.block_hash is None
    assert NULL not in [b.block_id for b in kv.pool._free.values()]
    assert kv.pool.get_cached_block(hash(())) is None
    all_held = held(kv, "a") + held(kv, "b")
    assert len(all_held) == len(set(all_held))  # no block in two places
    with pytest.raises(RuntimeError, match="cannot allocate"):
        kv.pool.get_new_blocks(kv.num_free_blocks + 1)  # the null block is not spare
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks == 8 and null.ref_cnt == 0


def test_abort_midway_and_truncate_return_every_block() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4, sliding_window=6)
    tokens = list(range(40))
    c = 0
    while c < 30:
        assert kv.allocate_slots("a", tokens, c + 3, num_computed_tokens=c)
        c += 3
    # A speculative step: slots for 4 drafts past 30, then a rollback to 31 accepted tokens.
    assert kv.allocate_slots("a", tokens[:31], 35, num_computed_tokens=30)
    released = kv.num_released_blocks("a")
    kv.truncate("a", 31)
    assert kv.num_released_blocks("a") == released and len(kv.block_ids("a")) == 8
    assert kv.num_free_blocks == kv.num_blocks - len(held(kv, "a"))
    kv.free("a")  # abort: the scheduler frees whatever is held
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_released_blocks("a") == 0


def test_admission_counts_the_blocks_a_step_releases() -> None:
    """A pool of exactly max_blocks_held blocks runs a long sequence; can_allocate agrees
    with allocate_slots at every step (the released blocks are counted as free)."""
    bs, window, chunk = 4, 10, 8
    need = max_blocks_held(200, chunk, window, bs)
    kv = KVCacheManager(num_blocks=need + 1, block_size=bs, sliding_window=window)
    tokens = list(range(200))
    c = 0
    while c < 200:
        assert kv.can_allocate("a", c + chunk, num_computed_tokens=c)
        assert kv.allocate_slots("a", tokens, c + chunk, num_computed_tokens=c)
        c += chunk
    assert not KVCacheManager(num_blocks=need + 1, block_size=bs).allocate_slots("x", tokens, 200)


def test_released_blocks_stay_cached_and_a_hit_needs_only_the_window() -> None:
    """a's released full blocks keep their hash. Once its first blocks are evicted, b (same
    prompt) still hits: only the blocks its first query reads must be cached. A hit never
    returns a block that was evicted and reused."""
    bs, window = 4, 6
    kv = KVCacheManager(num_blocks=12, block_size=bs, sliding_window=window)
    prompt = list(range(300, 325))  # 6 full blocks + 1
    c = 0
    while c < 25:
        assert kv.allocate_slots("a", prompt, min(c + 4, 25), num_computed_tokens=c)
        c = min(c + 4, 25)
    hashes = kv.block_hashes("a", prompt)
    kv.free("a")
    assert all(kv.pool.get_cached_block(h) is not None for h in hashes)
    # Another request takes every uncached free block and two more: the two cached blocks
    # freed first, a's blocks 0 and 1 (released as it went), lose their hash.
    num_uncached = kv.num_free_blocks - len(hashes)
    assert kv.allocate_slots("x", list(range(900, 900 + 4 * (num_uncached + 2))),
                             4 * (num_uncached + 2))
    cached = [kv.pool.get_cached_block(h) is not None for h in hashes]
    assert cached == [False, False, True, True, True, True]
    hits = kv.get_computed_blocks("b", prompt)
    assert len(hits) == 6  # 24 tokens: the query at 24 reads keys 19.., blocks 4 and 5
    assert [b.block_id for b in hits[:4]] == [NULL] * 4
    assert [b.block_hash for b in hits[4:]] == hashes[4:]
    assert kv.allocate_slots("b", prompt, 25, hits, num_computed_tokens=24)
    assert kv.block_ids("b")[:4] == [NULL] * 4
    # Evict block 4's content: no hit may end after it now (block 5's query needs it).
    kv.free("x")
    kv.free("b")
    evict = kv.pool.get_cached_block(hashes[4])
    while evict.block_hash is not None:
        kv.pool.get_new_blocks(1)
    hits = kv.get_computed_blocks("c", prompt)
    assert all(h.block_id == NULL or kv.pool.get_cached_block(h.block_hash) is h for h in hits)
    assert len(hits) < 5


def test_longest_window_hit_scans_for_the_run_the_window_needs() -> None:
    present = {0, 1, 3, 4, 5, 7}  # block indices cached (hash = index)
    lookup = lambda h: f"b{h}" if h in present else None  # noqa: E731
    # block_size 4, W 6: a hit of k blocks computes from 4k, whose query reads keys 4k - 5..,
    # i.e. blocks (4k - 5) // 4 .. k - 1. k = 9: 7, 8 (8 missing); k = 8: 6, 7 (6 missing);
    # k = 7: 5, 6 (6 missing); k = 6: 4, 5 (both cached).
    assert longest_window_hit(list(range(9)), lookup, 6, 4) == (6, ["b4", "b5"])
    # A window wider than the prefix needs every block from 0: only 0, 1 qualify.
    assert longest_window_hit(list(range(9)), lookup, 100, 4) == (2, ["b0", "b1"])
    assert longest_window_hit(list(range(9)), lambda h: None, 6, 4) == (0, [])
    assert longest_window_hit([], lookup, 6, 4) == (0, [])


def test_without_a_window_nothing_is_released() -> None:
    """No null block reserved, every block kept."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.pool.null_block is None and kv.num_blocks == 8
    assert kv.allocate_slots("a", list(range(20)), 20, num_computed_tokens=19)
    assert NULL in kv.block_ids("a") or len(held(kv, "a")) == 5
    assert kv.num_free_blocks == 3
