"""Block tables for a model whose layers use several tables (kv_cache/layout.py).

One KVCacheManager per table, all drawing blocks (pages) from one shared pool: a request gets
a table in each, every table as long as its tokens need (a windowed table's entries behind
the window are the null block). The scheduler and the engine call this class exactly as they
call a KVCacheManager:

- prefix-cache hits are a list of tuples, one block per table for each hit block position,
  so `len(hits)` is still the number of blocks hit. A position counts as hit only when every
  table has what it needs there: the full tables' blocks up to it, the windowed tables' blocks
  their window still reads;
- space is checked for all tables at once against the shared free queue, before any of them
  changes: `allocate_slots` gives all tables their blocks or changes nothing;
- `block_ids` returns one row per table (the model runner's batch carries them all);
  `req_to_blocks` and `num_released_blocks` are table 0's. (A separate draft model has a
  manager of its own, spec_decode/draft_cache.py.)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from argosy_runtime.kv_cache.block_pool import BlockPool
from argosy_runtime.kv_cache.kv_cache_manager import KVCacheManager

Hit = tuple  # one block per table


class HybridKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 table_windows: Sequence[int | None]) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching,
                              reserve_null_block=any(w is not None for w in table_windows))
        self.tables = [KVCacheManager(num_blocks, block_size, enable_caching, window,
                                      pool=self.pool, table_id=t)
                       for t, window in enumerate(table_windows)]
        self.req_to_blocks = self.tables[0].req_to_blocks

    # ---- what the engine reads ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def prefix_cache_queries(self) -> int:
        return self.tables[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.tables[0].prefix_cache_hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.tables[0].record_prefix_lookup(num_tokens, num_hit_tokens)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        return sum(t.max_blocks_held(num_tokens, max_step_tokens) for t in self.tables)

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [t.block_ids(request_id) for t in self.tables]

    def num_released_blocks(self, request_id: str) -> int:
        return self.tables[0].num_released_blocks(request_id)

    # ---- prefix hits -------------------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            num_lookup_tokens: int | None = None, salt: int | None = None,
                            exclude: Collection[str] = ()) -> list[Hit]:
        """The longest prefix every table has cached (see the module doc)."""
        if not self.enable_caching:
            return []
        limit = len(token_ids) - 1 if num_lookup_tokens is None else num_lookup_tokens
        num_hit = limit // self.block_size
        while True:  # each table may only shorten the hit; stop when all agree
            hits = [t.get_computed_blocks(request_id, token_ids, num_hit * self.block_size,
                                          salt, exclude) for t in self.tables]
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                return list(zip(*hits))
            num_hit = shortest

    # ---- allocation --------------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int, computed: Sequence[Hit] = (),
                     extra_free: int = 0, num_computed_tokens: int = 0) -> bool:
        per_table = _per_table(computed, len(self.tables))
        taken = sum(t.num_blocks_taken(request_id, num_tokens, hits, num_computed_tokens)
                    for t, hits in zip(self.tables, per_table))
        return taken <= self.pool.num_free_blocks + extra_free

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_total_tokens: int,
                       computed: Sequence[Hit] = (), salt: int | None = None,
                       num_computed_tokens: int = 0) -> bool:
        """Every table's blocks for the first `num_total_tokens` tokens, or False changing
        nothing."""
        if not self.can_allocate(request_id, num_total_tokens, computed,
                                 num_computed_tokens=num_computed_tokens):
            return False
        # Every table releases and takes its hits before any takes new blocks: else one
        # table's new block could be a cached-free hit another table is about to take, and
        # both would write it. can_allocate counted all of it against the free queue.
        per_table = _per_table(computed, len(self.tables))
        for t, hits in zip(self.tables, per_table):
            t.take_computed_blocks(request_id, hits, num_computed_tokens)
        for t in self.tables:
            t.take_new_blocks(request_id, token_ids, num_total_tokens, salt)
        return True

    def num_blocks_freed_by(self, request_ids: Iterable[str], keep: Sequence[Hit] = ()) -> int:
        request_ids = list(request_ids)
        return sum(t.num_blocks_freed_by(request_ids, hits)
                   for t, hits in zip(self.tables, _per_table(keep, len(self.tables))))

    # ---- per step and per request: every table alike --------------------------------------------
    def begin_step(self) -> None:
        for t in self.tables:
            t.begin_step()

    def unhash_step_blocks(self, request_id: str | None = None) -> None:
        for t in self.tables:
            t.unhash_step_blocks(request_id)

    def free(self, request_id: str) -> None:
        for t in self.tables:
            t.free(request_id)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        for t in self.tables:
            t.truncate(request_id, num_tokens)


def _per_table(hits: Sequence[Hit], num_tables: int) -> list[list]:
    """Hits as one list of blocks per table."""
    return [[hit[t] for hit in hits] for t in range(num_tables)]
