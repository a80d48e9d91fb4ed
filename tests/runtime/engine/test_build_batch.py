"""build_batch: the flattened inputs and attention metadata of one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from argosy_runtime.attention.batch import build_batch, decode_rows_first

CPU = torch.device("cpu")
BLOCK = 4


def test_decodes_then_chunks() -> None:
    a, b = np.array([7, 2]), np.array([5, 1, 9])
    ids, pos, meta = build_batch([(a, 5, [11]), (b, 2, [12, 13, 14, 15, 16, 17])], BLOCK, CPU)
    assert ids.tolist() == [11, 12, 13, 14, 15, 16, 17]
    assert pos.tolist() == [5, 2, 3, 4, 5, 6, 7]
    # position p lives in block p // 4 of the sequence's table, slot p % 4 of that block
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 1 * 4, 1 * 4 + 1, 1 * 4 + 2,
                                          1 * 4 + 3]
    assert meta.num_decodes == 1 and meta.decode_context_lens.tolist() == [6]
    assert meta.prefill_query_lens == [6] and meta.prefill_seq_lens == [8]


def test_short_chunks_as_decode_rows() -> None:
    # A 3-token chunk at positions 5..7 becomes three decode rows on the same block table,
    # seeing 6, 7 and 8 tokens; the 6-token chunk stays a prefill chunk.
    a, b = np.array([7, 2]), np.array([5, 1, 9])
    entries = [(a, 5, [11, 12, 13]), (b, 2, [14, 15, 16, 17, 18, 19])]
    _, pos, meta = build_batch(entries, BLOCK, CPU, decode_rows_up_to=3)
    assert pos.tolist()[:3] == [5, 6, 7]
    assert meta.num_decodes == 3
    assert meta.decode_context_lens.tolist() == [6, 7, 8]
    assert meta.decode_block_tables.tolist() == [[7, 2]] * 3
    assert meta.prefill_query_lens == [6]
    with pytest.raises(ValueError, match="decode rows"):
        build_batch(entries[::-1], BLOCK, CPU, decode_rows_up_to=3)
    # decode_rows_first gives the order build_batch needs, stable within each group
    assert decode_rows_first([6, 3, 1, 9, 3], 3) == [1, 2, 4, 0, 3]
    assert decode_rows_first([6, 3, 1, 9, 3]) == [2, 0, 1, 3, 4]


def test_one_block_table_per_row_gives_metadata_per_table() -> None:
    """Entries with block ids per table (a hybrid KV layout): each table's slots and tables
    come from its own row, contiguous (the C++ kernels refuse strided ones); the lengths
    are shared. Table 1's leading null entries (0) are kept as they are."""
    a = np.array([[7, 2, 3], [0, 4, 6]])
    b = np.array([[5, 1], [8, 9]])
    _, _, meta = build_batch([(a, 9, [11]), (b, 2, [12, 13, 14])], BLOCK, CPU)
    assert meta.for_table(0) is meta and meta.table_metadata is not None
    one = meta.for_table(1)
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 1 * 4]
    assert one.slot_mapping.tolist() == [6 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 9 * 4]
    assert meta.decode_block_tables.tolist() == [[7, 2, 3]]
    assert one.decode_block_tables.tolist() == [[0, 4, 6]]
    assert meta.prefill_block_tables.tolist() == [[5, 1]]
    assert one.prefill_block_tables.tolist() == [[8, 9]]
    assert one.decode_context_lens is meta.decode_context_lens
    for m in (meta, one):
        for t in (m.slot_mapping, m.decode_block_tables, m.prefill_block_tables):
            assert t.is_contiguous()
    # One table: no per-table list, and for_table(0) is the metadata itself.
    _, _, single = build_batch([(a[0], 9, [11])], BLOCK, CPU)
    assert single.table_metadata is None and single.for_table(0) is single


def test_a_block_table_too_short_for_its_positions_is_refused() -> None:
    """Positions 4-8 need 3 blocks of 4: with 2, the last slots would have come from the
    zero padding (block 0, a windowed table's null block)."""
    with pytest.raises(ValueError, match="cannot hold positions up to 8"):
        build_batch([(np.array([3, 5]), 4, [1, 2, 3, 4, 5])], BLOCK, CPU)
    with pytest.raises(IndexError, match="one table"):
        build_batch([(np.array([3, 5]), 4, [1])], BLOCK, CPU)[2].for_table(1)
