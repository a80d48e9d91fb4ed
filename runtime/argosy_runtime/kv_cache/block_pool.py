"""A pool of fixed-size KV-cache blocks with reference counts and an LRU of free blocks.

A block whose reference count drops to zero goes to the back of the free queue but keeps its
prefix-cache hash, so a later request with the same prefix can take it back ("cached free").
New allocations take blocks from the front of the queue (least recently freed first) and
evict their hash at that moment. Cached-free blocks therefore count as free for usage.

With `reserve_null_block` (sliding-window models, kv_cache/sliding_window.py) block 0 is the
"null block": never handed out, cached or freed, so it stays zero-filled. Block-table entries
of blocks released behind the window point at it, so a kernel that reads a whole table and
masks (the PyTorch decode path, the C++ prefill kernel's first key tile) reads finite zeros,
never another request's K/V being written in the same step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}"
                             + (" (one is the null block)" if reserve_null_block else ""))
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if reserve_null_block else None
        # block_id -> block, in LRU order (front = evicted first). Only ref_cnt == 0 blocks.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block
        )
        self._cached: dict[int, KVCacheBlock] = {}  # block hash -> block holding those tokens

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (removing them from the free queue)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Mark a full block as holding the tokens identified by `block_hash`. True when this
        call gave the block its hash (False: it had one already, or caching is off)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return False
        if block_hash in self._cached:
            # Another block holds these tokens already (this one was recomputed: no hits
            # allowed, or computed beside it). A lookup never finds this copy, so it stays
            # unhashed: once free it is evicted first, not kept at the back of the LRU ahead
            # of the cached original. (Its request offers it again each step: it becomes
            # the cached one if the original is evicted meanwhile.)
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget the block's hash (its K/V were never written): no lookup finds it, and once
        free it is reused first, like any uncached block."""
        self._evict(block)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. Pass blocks tail-first so a request's last blocks (the
        least likely to be shared) are evicted before its first ones. The null block is
        skipped: it holds no reference."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    # Uncached blocks are reused first: put them at the front.
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block. Blocks that requests hold keep their hash: their
        K/V are written, and their managers offer each block to the cache only once."""
        for block in self._free.values():
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
