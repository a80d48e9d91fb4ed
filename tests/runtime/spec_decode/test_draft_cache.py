"""How big a separate draft's own cache is (spec_decode/draft_cache.py): room for what the
target holds, in pages of the draft's own layout."""

from __future__ import annotations

import pytest
from argosy_runtime.kv_cache import kv_cache_layout, single_table_layout
from argosy_runtime.spec_decode.draft_cache import draft_pages_per_target_page


def gemma3_layout(num_layers: int):  # noqa: ANN201
    """Gemma 3's pattern (every sixth layer full, a window of 512) at 8k tokens."""
    windows = [None if i % 6 == 5 else 512 for i in range(num_layers)]
    return kv_cache_layout(windows, num_layers, 8192)


def test_gemma3_layouts() -> None:
    big, small = gemma3_layout(62), gemma3_layout(26)  # gemma-3-27b, gemma-3-1b
    assert (big.num_tables, big.table_windows.count(None)) == (5, 1)
    assert (small.num_tables, small.table_windows.count(None)) == (7, 1)


@pytest.mark.parametrize("target,draft,ratio", [
    # Laid out alike (a quantized copy): a page per page.
    (gemma3_layout(26), gemma3_layout(26), 1.0),
    (single_table_layout(30), single_table_layout(12), 1.0),
    # While short, a block of a sequence takes a page in every table: 7 draft pages to 5.
    (gemma3_layout(62), gemma3_layout(26), 7 / 5),
    # Past the windows, in the full tables only: 1 draft page to the target's 1 (a larger
    # ratio while short, 7 to 1, still rules).
    (single_table_layout(30), gemma3_layout(26), 7.0),
    # A draft on one table beside a hybrid target: once past the windows the target takes
    # a page in its one full table per block, and the draft one too.
    (gemma3_layout(26), single_table_layout(12), 1.0),
    # A target all windowed (Mistral) holds little of a long sequence; by tables, 1 to 1.
    (single_table_layout(32, window=4096), single_table_layout(12), 1.0),
])
def test_draft_pages_per_target_page(target, draft, ratio: float) -> None:  # noqa: ANN001
    assert draft_pages_per_target_page(target, draft) == pytest.approx(ratio)
