"""Per-request block tables on top of the block pool, with automatic prefix caching.

A full block is identified by a hash chain: hash(parent block's hash, this block's tokens),
so equal hashes mean equal whole prefixes. Only full blocks are cached; the last partial block
of a request is always private to it.

With `sliding_window` set (the layers this table serves attend through that window: every
layer of a Mistral, or a hybrid layout's windowed layers, kv_cache/layout.py), blocks that
fall behind the window are released as the request advances (kv_cache/sliding_window.py):
their table entries point at the pool's null block from then on, so a request holds about
W / block_size + the step's blocks however long it grows. Released full blocks keep their
hash like any freed block, and a prefix lookup needs only the blocks the window still reads.

Blocks become cache entries when a step is scheduled, before it runs (a request admitted later
in the same step may share them: every layer writes the step's K/V before attention reads).
The manager remembers which blocks each request hashed since `begin_step`, so that a step's
tokens that will not run after all (a request scheduled, then preempted in the same
`schedule()`; a forward that raised) leave no entries: `unhash_step_blocks`. And a lookup may
exclude what given requests hashed in this step (`get_computed_blocks(exclude=...)`), so no
request holds a hit that depends on another that may still be preempted before the step runs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Collection, Iterable, Sequence

from argosy_runtime.kv_cache.block_pool import BlockPool, KVCacheBlock
from argosy_runtime.kv_cache.sliding_window import (
    longest_window_hit,
    max_blocks_held,
    num_skipped_blocks,
)


def hash_block_tokens(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """128 bits of SHA-256 over the parent's hash (or the chain's salt) and the tokens.

    Not Python's `hash`: ints hash modulo 2**61 - 1 and its tuple hash can be inverted, so a
    client could craft a block whose hash equals another tenant's cached prefix and have that
    tenant's requests served its K/V (vLLM's CVE-2025-25183 was such a collision)."""
    digest = hashlib.sha256()
    if parent_hash is not None:  # 17 bytes hold a 128-bit hash and a negative salt alike
        digest.update(parent_hash.to_bytes(17, "little", signed=True))
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest()[:16], "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, pool: BlockPool | None = None,
                 table_id: int = 0) -> None:
        """`sliding_window`: the window of the layers this table serves (blocks behind it are
        then released early); None for full attention. `pool`: a pool shared with other
        tables (kv_cache/hybrid_kv_cache_manager.py; it must reserve the null block if this
        table slides), whose cache entries this table keys apart by its `table_id`."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.table_id = table_id
        self.pool = pool if pool is not None else BlockPool(
            num_blocks, enable_caching, reserve_null_block=sliding_window is not None)
        if sliding_window is not None and self.pool.null_block is None:
            raise ValueError("a sliding-window table needs a pool with a null block")
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_block_hashes: dict[str, list[int]] = {}
        # request id -> how many leading table entries are the null block (released), so
        # each step looks only at the blocks that newly fell behind the window.
        self._num_released: dict[str, int] = {}
        # request id -> blocks it gave a hash since begin_step (their K/V are this step's).
        self._hashed_this_step: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading table entries hold a cache entry (or are the null
        # block): a step offers the cache only the full blocks after them, not the whole
        # table again (that cost grew with every running request's context, each step).
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up (by admitted requests)
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block, if any, is not one)."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_hashes(self, request_id: str, token_ids: Sequence[int],
                     salt: int | None = None) -> list[int]:
        """Hashes of every full block of `token_ids`, extended incrementally per request.
        `salt` seeds the chain: requests whose equal tokens have different K/V (another
        LoRA adapter) never share blocks."""
        hashes = self._req_block_hashes.setdefault(request_id, [])
        bs = self.block_size
        if self.table_id and not hashes:  # another table's pages for the same tokens
            salt = hash_block_tokens(salt, (-self.table_id,))  # no block holds a negative id
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            parent = hashes[-1] if hashes else salt
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], num_lookup_tokens: int | None = None,
        salt: int | None = None, exclude: Collection[str] = (),
    ) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that prefixes `token_ids`.

        At most `len(token_ids) - 1` tokens are reused: the last token must be computed to
        produce logits. The caller takes references with `allocate_slots(..., computed)`.
        With a sliding window, only the blocks the window still reads must be cached: the
        ones before it are the null block (`allocate_slots` keeps them so). Blocks that the
        requests in `exclude` hashed since `begin_step` are misses (their K/V are written
        only if those requests still run in this step).
        """
        if not self.enable_caching:
            return []
        limit = len(token_ids) - 1 if num_lookup_tokens is None else num_lookup_tokens
        hashes = self.block_hashes(request_id, token_ids, salt)[: limit // self.block_size]
        excluded = {b.block_id for rid in exclude for b in self._hashed_this_step.get(rid, ())}
        lookup = self.pool.get_cached_block
        if excluded:
            def lookup(block_hash: int) -> KVCacheBlock | None:
                block = self.pool.get_cached_block(block_hash)
                return None if block is None or block.block_id in excluded else block
        hits: list[KVCacheBlock] = []
        if self.sliding_window is not None and self.pool.null_block is not None:
            num_hit, needed = longest_window_hit(hashes, lookup, self.sliding_window,
                                                 self.block_size)
            hits = [self.pool.null_block] * (num_hit - len(needed)) + needed
        else:
            for block_hash in hashes:
                block = lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count the lookup a request was admitted with. Not counted in `get_computed_blocks`:
        a head of the queue that cannot be admitted yet is looked up again every step, and
        counting each of those would inflate both counters past the requests' cached_tokens
        and skew the hit rate toward whoever waits longest."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _num_skipped(self, num_computed_tokens: int) -> int:
        return num_skipped_blocks(num_computed_tokens, self.sliding_window, self.block_size)

    def can_allocate(self, request_id: str, num_tokens: int,
                     computed: Sequence[KVCacheBlock] = (), extra_free: int = 0,
                     num_computed_tokens: int = 0) -> bool:
        """Would `allocate_slots` succeed now (with `extra_free` more free blocks)?"""
        return (self.num_blocks_taken(request_id, num_tokens, computed, num_computed_tokens)
                <= self.pool.num_free_blocks + extra_free)

    def num_blocks_taken(self, request_id: str, num_tokens: int,
                         computed: Sequence[KVCacheBlock] = (),
                         num_computed_tokens: int = 0) -> int:
        """How many blocks `allocate_slots` would take out of the free queue, net: new
        blocks, plus cache hits sitting in it (they stop being free once touched; not those
        behind the window, which are never touched), less the blocks falling behind the
        window (they come back, unless another request shares them)."""
        blocks = self.req_to_blocks.get(request_id, [])
        need = max(0, -(-num_tokens // self.block_size) - len(blocks) - len(computed))
        skip = self._num_skipped(num_computed_tokens)
        taken = sum(1 for i, b in enumerate(computed, len(blocks))
                    if i >= skip and b.ref_cnt == 0 and b is not self.pool.null_block)
        returned = sum(1 for b in blocks[self._num_released.get(request_id, 0) : skip]
                       if b.ref_cnt == 1)
        return need + taken - returned

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once when a step adds
        at most `max_step_tokens` of them (kv_cache/sliding_window.py)."""
        return max_blocks_held(num_tokens, max_step_tokens, self.sliding_window,
                               self.block_size)

    def num_blocks_freed_by(self, request_ids: Iterable[str],
                            keep: Sequence[KVCacheBlock] = ()) -> int:
        """How many blocks freeing these requests would return to the pool, not counting
        `keep` (prefix hits the caller is about to take). A shared block returns only when
        every request holding it is among them."""
        refs: Counter[int] = Counter()
        by_id: dict[int, KVCacheBlock] = {}
        for rid in request_ids:
            for block in self.req_to_blocks.get(rid, ()):
                refs[block.block_id] += 1
                by_id[block.block_id] = block
        kept = {b.block_id for b in keep}
        if self.pool.null_block is not None:  # never returned: it is nobody's
            kept.add(self.pool.null_block.block_id)
        return sum(1 for bid, n in refs.items() if by_id[bid].ref_cnt == n and bid not in kept)

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_total_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        salt: int | None = None,
        num_computed_tokens: int = 0,
    ) -> bool:
        """Make room for the first `num_total_tokens` tokens of the request.

        `computed` are prefix-cache hits from `get_computed_blocks` (only on first schedule).
        `num_computed_tokens`: where the tokens to compute next start (final tokens only,
        never speculative ones); with a sliding window the blocks no query from there on
        reads are released first (0: none). Returns False, changing nothing, when the pool is
        too small right now.
        """
        if not self.can_allocate(request_id, num_total_tokens, computed,
                                 num_computed_tokens=num_computed_tokens):
            return False
        self.take_computed_blocks(request_id, computed, num_computed_tokens)
        self.take_new_blocks(request_id, token_ids, num_total_tokens, salt)
        return True

    # allocate_slots' two phases, once `can_allocate` said yes. A hybrid layout's tables
    # (kv_cache/hybrid_kv_cache_manager.py) run the first on every table before the second:
    # then no table's new block can be a cached-free hit another table is about to take.
    def take_computed_blocks(self, request_id: str, computed: Sequence[KVCacheBlock],
                             num_computed_tokens: int) -> None:
        """Release the blocks behind the window, then take references on the hits."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        skip = self._num_skipped(num_computed_tokens)
        self._release_behind_window(request_id, blocks, skip)
        if computed:
            # Hits behind the window are not taken: their entries are the null block.
            start = len(blocks)
            null = self.pool.null_block
            computed = [null if i < skip and null is not None else b
                        for i, b in enumerate(computed, start)]
            self.pool.touch(computed)
            blocks.extend(computed)
            if null is not None:
                self._num_released[request_id] = min(skip, len(blocks))

    def take_new_blocks(self, request_id: str, token_ids: Sequence[int], num_total_tokens: int,
                        salt: int | None = None) -> None:
        """New blocks up to `num_total_tokens`; the full ones become cache entries."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        need = -(-num_total_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if self.enable_caching:
            # Blocks whose tokens are all known are cacheable now: within a step every layer
            # writes all new K/V before any attention reads, so a same-step hit is safe.
            # Only final tokens are hashed (draft tokens are not in `token_ids`).
            num_full = min(num_total_tokens, len(token_ids)) // self.block_size
            hashes = self.block_hashes(request_id, token_ids, salt)
            num_cached = self._num_cached_blocks.get(request_id, 0)
            for i in range(num_cached, num_full):
                block = blocks[i]
                if self.pool.cache_block(block, hashes[i]):
                    self._hashed_this_step.setdefault(request_id, []).append(block)
                # A copy of a block cached elsewhere stays unhashed (BlockPool.cache_block)
                # and stops the count: it is offered again each step, to become the cached
                # one if the original is evicted.
                if num_cached == i and (block.block_hash is not None
                                        or block is self.pool.null_block):
                    num_cached += 1
            self._num_cached_blocks[request_id] = num_cached

    def begin_step(self) -> None:
        """A new step is being scheduled: the blocks hashed before hold written K/V."""
        self._hashed_this_step.clear()

    def unhash_step_blocks(self, request_id: str | None = None) -> None:
        """Forget the hashes given since `begin_step` (by `request_id`, or by everyone): the
        step will not write those blocks (the request was taken out of it, or it failed).
        Call before freeing the request, so its blocks are reused first, not kept."""
        if request_id is None:
            hashed = [b for blocks in self._hashed_this_step.values() for b in blocks]
            self._hashed_this_step.clear()
            self._num_cached_blocks.clear()
        else:
            hashed = self._hashed_this_step.pop(request_id, [])
            self._num_cached_blocks.pop(request_id, None)
        for block in hashed:
            self.pool.uncache_block(block)

    def _release_behind_window(self, request_id: str, blocks: list[KVCacheBlock],
                               skip: int) -> None:
        """Give back blocks released..skip - 1 (no future query reads them): one reference
        each, so a block another request shares stays for it; a full one keeps its hash.
        Their entries become the null block, which kernels may read (and mask) safely."""
        null = self.pool.null_block
        released = self._num_released.get(request_id, 0)
        skip = min(skip, len(blocks))
        if null is None or skip <= released:
            return
        # Oldest first: they go to the free queue (and are evicted) before the later ones.
        self.pool.free_blocks(blocks[released:skip])
        blocks[released:skip] = [null] * (skip - released)
        self._num_released[request_id] = skip

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        self._req_block_hashes.pop(request_id, None)
        self._num_released.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks needed for the first `num_tokens` tokens (speculative rollback)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        keep = -(-num_tokens // self.block_size)
        if keep < len(blocks):
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(reversed(extra))
            if self._num_released.get(request_id, 0) > keep:
                self._num_released[request_id] = keep
        num_full = num_tokens // self.block_size
        hashes = self._req_block_hashes.get(request_id)
        if hashes is not None and len(hashes) > num_full:
            del hashes[num_full:]
        if self._num_cached_blocks.get(request_id, 0) > num_full:
            self._num_cached_blocks[request_id] = num_full

    def num_released_blocks(self, request_id: str) -> int:
        """Leading table entries released behind the sliding window (the null block)."""
        return self._num_released.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
