"""Which cache memory and which block table each layer's K/V use (the hybrid KV layout).

The cache is a pool of pages: one page holds `block_size` tokens of K/V for `page_layers`
layers, and a layer reads its K/V through one block table (page ids, one per block of the
sequence). A model whose layers all attend alike has one table and pages of every layer.

A model that mixes sliding-window and full-attention layers (Gemma 2 alternates them, Gemma 3
has five windowed layers to one full) would, with one table, keep every block of every layer
for its full layers' sake. Here each kind of layer gets block tables of its own, drawing pages
from the same pool: a windowed table gives back the pages behind its window
(kv_cache/sliding_window.py), so a long request holds its full layers' pages plus only a
window's worth for the windowed ones. As in vLLM's hybrid allocator, the layers of a kind are
cut into chunks of `page_layers` (the last one padded), one table per chunk, so that every
table's pages are the same size and one pool serves them all: with Gemma 3's 4 full and 22
windowed layers, pages of 4 layers, one full table and 6 windowed ones (2 padding layers).

Windows no shorter than `max_model_len` never hide a key, so they count as full attention
here; a model whose windowed layers all share one window (Mistral) keeps one table, which
releases blocks itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The padding one may add for fewer tables: at most this share of the layers.
MAX_PADDING = 0.1


@dataclass(frozen=True)
class KVCacheLayout:
    page_layers: int  # layers whose K/V one page holds
    layer_slots: tuple[int, ...]  # per layer: its index within a page
    layer_tables: tuple[int, ...]  # per layer: the block table it reads (0 first)
    table_windows: tuple[int | None, ...]  # per table: its window, None for full attention

    @property
    def num_tables(self) -> int:
        return len(self.table_windows)

    @property
    def is_hybrid(self) -> bool:
        return self.num_tables > 1


def single_table_layout(num_layers: int, window: int | None = None) -> KVCacheLayout:
    """Every layer on one table, pages of all of them (`window`: every layer's)."""
    return KVCacheLayout(num_layers, tuple(range(num_layers)), (0,) * num_layers, (window,))


def kv_cache_layout(layer_windows: Sequence[int | None], num_layers: int,
                    max_model_len: int) -> KVCacheLayout:
    """The layout for layers with these windows (ModelSpec.layer_sliding_windows, () when
    none slides). Full-attention layers take the first tables, so table 0 is a full one
    whenever the model has any."""
    windows = [w if w is not None and w < max_model_len else None
               for w in (layer_windows or [None] * num_layers)]
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # None first
    if len(kinds) == 1:
        return single_table_layout(num_layers, kinds[0])
    groups = [[i for i, w in enumerate(windows) if w == kind] for kind in kinds]
    page_layers = _page_layers([len(g) for g in groups], num_layers)
    slots, tables = [0] * num_layers, [0] * num_layers
    table_windows: list[int | None] = []
    for kind, layers in zip(kinds, groups):
        for j, layer in enumerate(layers):
            slots[layer] = j % page_layers
            tables[layer] = len(table_windows) + j // page_layers
        table_windows.extend([kind] * -(-len(layers) // page_layers))
    return KVCacheLayout(page_layers, tuple(slots), tuple(tables), tuple(table_windows))


def _page_layers(group_sizes: Sequence[int], num_layers: int) -> int:
    """The largest page (fewest tables) whose padding stays within MAX_PADDING of the
    layers; 1 always fits (no padding)."""
    for size in range(max(group_sizes), 0, -1):
        padded = sum(-(-n // size) * size for n in group_sizes)
        if padded <= num_layers * (1 + MAX_PADDING):
            return size
    return 1
