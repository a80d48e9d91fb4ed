"""Per-request block tables on top of the block pool, with automatic prefix caching.

A full block is identified by a hash chain: hash(parent block's hash, this block's tokens),
so equal hashes mean equal whole prefixes. Only full blocks are cached; the last partial block
of a request is always private to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from argosy_runtime.kv_cache.block_pool import BlockPool, KVCacheBlock


def hash_block_tokens(parent_hash: int | None, tokens: Sequence[int]) -> int:
    # Python's hash of a tuple of ints is deterministic across processes (no salt for ints).
    return hash((parent_hash, tuple(tokens)))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_block_hashes: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

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
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            parent = hashes[-1] if hashes else salt
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], num_lookup_tokens: int | None = None,
        salt: int | None = None,
    ) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that prefixes `token_ids`.

        At most `len(token_ids) - 1` tokens are reused: the last token must be computed to
        produce logits. The caller takes references with `allocate_slots(..., computed)`.
        """
        if not self.enable_caching:
            return []
        limit = len(token_ids) - 1 if num_lookup_tokens is None else num_lookup_tokens
        hashes = self.block_hashes(request_id, token_ids, salt)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[: limit // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def can_allocate(self, request_id: str, num_tokens: int,
                     computed: Sequence[KVCacheBlock] = (), extra_free: int = 0) -> bool:
        """Would `allocate_slots` succeed now (with `extra_free` more free blocks)?"""
        have = len(self.req_to_blocks.get(request_id, ())) + len(computed)
        need = -(-num_tokens // self.block_size) - have
        # Cache hits that are sitting in the free queue stop being free once touched.
        free = self.pool.num_free_blocks - sum(1 for b in computed if b.ref_cnt == 0)
        return need <= free + extra_free

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
        return sum(1 for bid, n in refs.items() if by_id[bid].ref_cnt == n and bid not in kept)

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_total_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        salt: int | None = None,
    ) -> bool:
        """Make room for the first `num_total_tokens` tokens of the request.

        `computed` are prefix-cache hits from `get_computed_blocks` (only on first schedule).
        Returns False, changing nothing, when the pool is too small right now.
        """
        if not self.can_allocate(request_id, num_total_tokens, computed):
            return False
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
        need = -(-num_total_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if self.enable_caching:
            # Blocks whose tokens are all known are cacheable now: within a step every layer
            # writes all new K/V before any attention reads, so a same-step hit is safe.
            num_full = min(num_total_tokens, len(token_ids)) // self.block_size
            hashes = self.block_hashes(request_id, token_ids, salt)
            for i in range(num_full):
                self.pool.cache_block(blocks[i], hashes[i])
        return True

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        self._req_block_hashes.pop(request_id, None)
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
        hashes = self._req_block_hashes.get(request_id)
        if hashes is not None and len(hashes) > num_tokens // self.block_size:
            del hashes[num_tokens // self.block_size :]

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
