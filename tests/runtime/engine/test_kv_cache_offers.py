"""Each step offers the prefix cache only the blocks that became full since the last one.

The scheduler allocates every running request's slots every step, and the manager makes
the full ones cache entries. Offering the whole table again each step cost a pass over every
running request's context per step: with 256 running requests of 4,000 tokens (16-token
blocks) a decode step's `Scheduler.schedule()` took 6.7-7.7 ms on this CPU, 1.1 ms now.
Blocks that could not be cached (a copy of a block cached elsewhere) are still offered
again, and so is every block a request hashed in a step that did not run.
"""

from __future__ import annotations

import pytest
from argosy_runtime.kv_cache import BlockPool, HybridKVCacheManager, KVCacheManager


def count_offers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    offered: list[int] = []
    original = BlockPool.cache_block
    monkeypatch.setattr(BlockPool, "cache_block", lambda self, block, block_hash:
                        offered.append(block.block_id) or original(self, block, block_hash))
    return offered


@pytest.mark.parametrize("window", [None, 6])
def test_a_decode_step_offers_only_its_new_full_block(window: int | None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=window)
    tokens = list(range(100, 140))  # 10 full blocks
    offered = count_offers(monkeypatch)
    assert kv.allocate_slots("a", tokens, 40)
    assert len(offered) == 10
    for step in range(12):  # decodes: one token each, a block full every 4th
        tokens.append(step)
        del offered[:]
        assert kv.allocate_slots("a", tokens, len(tokens), num_computed_tokens=len(tokens) - 1)
        assert len(offered) == (len(tokens) % 4 == 0)


def test_hybrid_tables_offer_only_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = HybridKVCacheManager(64, 4, True, [None, 6])
    tokens = list(range(100, 132))
    offered = count_offers(monkeypatch)
    assert kv.allocate_slots("a", tokens, 32)
    tokens.append(1)
    del offered[:]
    assert kv.allocate_slots("a", tokens, 33, num_computed_tokens=32)
    assert offered == []


def test_a_copy_is_offered_again_and_cached_once_the_original_is_evicted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(9))  # 2 full blocks + 1 token
    assert kv.allocate_slots("a", prompt, 9)
    assert kv.allocate_slots("b", prompt, 9)  # computed again (no hits taken): copies
    b_blocks = kv.req_to_blocks["b"]
    assert [blk.block_hash is None for blk in b_blocks] == [True, True, True]
    kv.free("a")
    assert kv.allocate_slots("c", list(range(50, 62)), 12)  # evicts a's 3 blocks
    assert kv.get_computed_blocks("z", prompt) == []
    prompt.append(7)
    assert kv.allocate_slots("b", prompt, 10, num_computed_tokens=9)
    assert [blk.block_id for blk in kv.get_computed_blocks("d", prompt)] == [
        blk.block_id for blk in b_blocks[:2]]


def test_blocks_of_a_step_that_did_not_run_are_offered_again() -> None:
    """The forward raised (unhash_step_blocks): the request, still running, computes the
    same tokens again in the next step, and then its blocks become entries."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    kv.begin_step()
    assert kv.allocate_slots("a", prompt, 9)
    kv.unhash_step_blocks()
    assert kv.get_computed_blocks("b", prompt) == []
    kv.begin_step()
    assert kv.allocate_slots("a", prompt, 9)
    assert len(kv.get_computed_blocks("b", prompt)) == 2


def test_reset_forgets_cached_free_blocks_only() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    held, freed = list(range(9)), list(range(50, 59))
    assert kv.allocate_slots("a", held, 9)
    assert kv.allocate_slots("b", freed, 9)
    kv.free("b")
    kv.pool.reset_prefix_cache()
    assert kv.get_computed_blocks("x", freed) == []
    # a's blocks hold written K/V and a offers them only once: they stay entries.
    assert len(kv.get_computed_blocks("y", held)) == 2
    kv.free("a")
    assert kv.num_free_blocks == 8
