"""KV cache manager accounting against what allocation and freeing really do, on random
operations (full, windowed and hybrid tables; prefix hits, decodes, speculative rollbacks).

The scheduler admits and preempts on predictions: `num_blocks_taken` (through `can_allocate`)
must equal the free blocks an `allocate_slots` then takes, and `num_blocks_freed_by` the ones
freeing those requests returns. Too low and `get_new_blocks` raises mid-step; too high and a
request waits (or someone is preempted) for room that was there. Every hit must hold the
tokens (and salt) it is looked up for, and when a cached block is evicted no uncached free
block, nor a cached one freed earlier, may be left (tail-first LRU).
"""

from __future__ import annotations

import copy
import random

import pytest
from argosy_runtime.kv_cache import HybridKVCacheManager, KVCacheManager


def _run(seed: int, windows: list) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4])
    nb = rng.randint(6, 24)
    if len(windows) > 1:
        kv = HybridKVCacheManager(nb + 1, bs, True, windows)
        tables = kv.tables
    else:
        kv = KVCacheManager(nb + (windows[0] is not None), bs, True, windows[0])
        tables = [kv]
    pool, null = kv.pool, kv.pool.null_block
    hybrid = isinstance(kv, HybridKVCacheManager)
    bases = [[rng.randrange(4) for _ in range(16)] for _ in range(2)]
    reqs: dict[str, list] = {}  # id -> [final tokens, tokens with K/V, salt]
    content: dict[tuple[int, int], tuple] = {}  # (table, block id) -> what it holds
    freed_at: dict[int, int] = {}  # block id -> when it last went to the free queue
    clock = 0

    def write(rid: str, start: int, end: int, tokens: list[int], salt: object) -> None:
        for t, table in enumerate(tables):
            for p in range(start, end):
                block = table.req_to_blocks[rid][p // bs]
                assert block is not null
                content[(t, block.block_id)] = (salt, tuple(tokens[: (p // bs + 1) * bs]))

    def allocate(rid: str, tokens: list[int], n: int, hits: list, salt: object,
                 num_computed: int) -> bool:
        nonlocal clock
        per_table = [[h[t] for h in hits] for t in range(len(tables))] if hybrid else [hits]
        predicted = sum(t.num_blocks_taken(rid, n, h, num_computed)
                        for t, h in zip(tables, per_table))
        free = {bid: b.block_hash is not None for bid, b in pool._free.items()}
        before = pool.num_free_blocks
        if not kv.allocate_slots(rid, tokens, n, hits, salt=salt, num_computed_tokens=num_computed):
            assert predicted > before
            return False
        assert before - pool.num_free_blocks == predicted
        for bid in pool._free:
            if bid not in free:  # released behind the window by this call: freed now
                clock += 1
                freed_at[bid] = clock
        left = {bid: b.block_hash is not None for bid, b in pool._free.items() if bid in free}
        for t in tables:
            for b in t.req_to_blocks[rid]:
                if b is not null and free.get(b.block_id) and b.block_hash != freed_hash[b.block_id]:
                    # a cached-free block evicted for a new block: LRU, uncached first
                    assert all(left.values())
                    assert all(freed_at.get(o, 0) > freed_at.get(b.block_id, 0)
                               for o in left)
        return True

    freed_hash: dict[int, object] = {}

    def snapshot_free() -> None:
        for bid, b in pool._free.items():
            freed_hash[bid] = b.block_hash

    for step in range(50):
        snapshot_free()
        op = rng.random()
        if op < 0.35 or not reqs:
            rid = f"r{step}"
            tokens = (rng.choice(bases)[: rng.randint(0, 16)]
                      + [rng.randrange(4) for _ in range(rng.randint(1, 4))])
            salt = rng.choice([None, 7])
            hits = kv.get_computed_blocks(rid, tokens, salt=salt)
            assert len(hits) * bs <= len(tokens) - 1  # the last token is always computed
            for i, hit in enumerate(hits):
                for t, block in enumerate(hit if hybrid else (hit,)):
                    if block is not null:
                        assert content[(t, block.block_id)] == (salt, tuple(tokens[: (i + 1) * bs]))
            nc = len(hits) * bs
            n = min(len(tokens), nc + rng.randint(1, 6))
            if allocate(rid, tokens, n, hits, salt, nc):
                write(rid, nc, n, tokens, salt)
                reqs[rid] = [tokens, n, salt]
            else:
                kv.free(rid)
        elif op < 0.8:  # the next chunk or decode, with drafts past the final tokens
            rid = rng.choice(list(reqs))
            tokens, nc, salt = reqs[rid]
            if nc == len(tokens):
                tokens.append(rng.randrange(4))
            drafts = [rng.randrange(4) for _ in range(rng.randint(0, 3))] \
                if nc == len(tokens) - 1 else []
            n = min(len(tokens), nc + rng.randint(1, 4)) + len(drafts)
            if not allocate(rid, tokens, n, [], salt, nc):
                continue
            final = min(n, len(tokens))
            write(rid, nc, final, tokens, salt)
            if drafts:  # accept some, roll back the rest
                accepted = rng.randint(0, len(drafts))
                tokens.extend(drafts[:accepted])
                write(rid, final, final + accepted, tokens, salt)
                final += accepted
                tokens.append(rng.randrange(4))
                kv.truncate(rid, final)
            reqs[rid][1] = final
        else:
            victims = rng.sample(list(reqs), rng.randint(1, min(2, len(reqs))))
            predicted = kv.num_blocks_freed_by(victims)
            before = pool.num_free_blocks
            for rid in victims:
                free_order = [b for t in tables for b in reversed(t.req_to_blocks[rid])]
                kv.free(rid)
                for b in free_order:
                    if b is not null and b.ref_cnt == 0:
                        clock += 1
                        freed_at[b.block_id] = clock
                del reqs[rid]
            assert pool.num_free_blocks - before == predicted
        assert 0.0 <= kv.usage() <= 1.0
        for b in pool.blocks:
            assert b.ref_cnt >= 0 and (b.block_id in pool._free) == (b.ref_cnt == 0
                                                                      and b is not null)
    for rid in list(reqs):
        kv.free(rid)
    assert pool.num_free_blocks == kv.num_blocks and kv.usage() == 0.0


@pytest.mark.parametrize("windows", [[None], [3], [None, 4], [None, 2, 5]],
                         ids=["full", "window", "hybrid", "hybrid3"])
def test_accounting_predicts_allocation_and_freeing_exactly(windows: list) -> None:
    for seed in range(60):
        _run(seed, copy.copy(windows))
