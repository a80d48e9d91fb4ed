"""Which KV-cache blocks a sliding-window sequence still needs.

When every layer attends through the same window W, a query at position p reads only the keys
p - W < k <= p. The next tokens of a sequence start at position `num_computed_tokens` (a
prompt chunk's first query sees the furthest back), so the keys it will ever read again start
at `num_computed_tokens - W + 1`: the blocks wholly before that one hold K/V that no future
query of the sequence reads, and the KV cache manager gives them back to the pool (vLLM's
SlidingWindowManager does the same). `num_computed_tokens` only counts tokens whose K/V are
final (speculative drafts sit after it and a rollback never goes below it), so a released
block is never needed again.

Models that mix windowed and full-attention layers (Gemma 2/3, Qwen2 with max_window_layers)
give their windowed layers block tables of their own (kv_cache/layout.py), which release
blocks the same way, while the full layers' tables keep all of theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Block = TypeVar("Block")


def num_skipped_blocks(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """How many leading blocks no query at position >= num_computed_tokens reads.

    The first query (position num_computed_tokens) sees keys from num_computed_tokens - W + 1,
    so every block ending at or before that position is skipped: with W = 10, block_size 4
    and 21 computed tokens, keys 12.. are read, blocks 0-2 (positions 0-11) are not.
    """
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_held(num_tokens: int, max_step_tokens: int, window: int | None,
                    block_size: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once when a step adds at
    most `max_step_tokens` of them: the window behind the step's first query plus the step's
    own tokens, at most one partial block at each end. Without a window: all of them."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + max_step_tokens) // block_size) + 1)


def longest_window_hit(block_hashes: Sequence[int], lookup: Callable[[int], Block | None],
                       window: int, block_size: int) -> tuple[int, list[Block]]:
    """The longest prefix of `block_hashes` whose blocks a windowed sequence needs are cached.

    A hit of k blocks lets the sequence compute from position k * block_size, which reads only
    blocks num_skipped_blocks(k * block_size) .. k - 1: the earlier ones may be evicted (a
    hash names the whole prefix, so a cached later block is valid on its own). Scans down from
    the longest candidate, keeping the run of cached blocks that ends at the candidate.
    Returns (k, the cached blocks num_skipped_blocks(...) .. k - 1), (0, []) for no hit.
    """
    run: list[Block] = []  # cached blocks i + 1 .. end - 1, last first
    end = len(block_hashes)
    for i in range(len(block_hashes) - 1, -1, -1):
        block = lookup(block_hashes[i])
        if block is None:  # candidates ending after i need block i: try those ending at i
            run, end = [], i
            continue
        run.append(block)
        skipped = num_skipped_blocks(end * block_size, window, block_size)
        if i <= skipped:
            return end, run[: end - skipped][::-1]
    return 0, []
