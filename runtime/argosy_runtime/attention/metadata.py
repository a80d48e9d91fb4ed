"""Per-step attention inputs for one flattened batch.

The runner orders sequences with one query token (decodes) first, then the sequences with
several (prompt chunks, speculative verification). Where the C++ decode layers run, short
chunks are decode rows too (one per token, see build_batch). Every layer reuses this object
(with a hybrid KV layout, every layer of the same block table: `for_table`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot of each new token
    num_decodes: int  # the first num_decodes tokens are decode rows: one query each
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decodes], the new token included
    # Multi-token sequences, in order after the decodes (python ints: used for slicing).
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]  # tokens in cache after this step, the chunk included
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    # Paged-kernel form of the prefill part (Triton path): offsets into the prefill tokens.
    prefill_query_start_loc: torch.Tensor | None = None  # int32 [num_prefills + 1]
    prefill_seq_lens_t: torch.Tensor | None = None  # int32 [num_prefills]
    # A hybrid KV layout (kv_cache/layout.py): the metadata of each block table, this one
    # (table 0) first; the others differ in their block tables and slots only. None: one table.
    table_metadata: list[AttentionMetadata] | None = None

    @staticmethod
    def of_tables(metas: list[AttentionMetadata]) -> AttentionMetadata:
        """The step's metadata from one per block table (table 0 first): table 0's, which
        reaches the others through `for_table` when there are several."""
        if len(metas) > 1:
            metas[0].table_metadata = metas
        return metas[0]

    def for_table(self, table: int) -> AttentionMetadata:
        if self.table_metadata is not None:
            return self.table_metadata[table]
        if table:
            raise IndexError(f"block table {table}: this step's metadata has one table")
        return self

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    def prefill_sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block tables, query_start_loc, seq_lens) of the multi-token sequences as the varlen
        kernels take them: contiguous int32, the optional fields filled in from the lists."""
        device = self.prefill_block_tables.device
        if self.prefill_query_start_loc is None:
            starts = [0]
            for q_len in self.prefill_query_lens:
                starts.append(starts[-1] + q_len)
            self.prefill_query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        if self.prefill_seq_lens_t is None:
            self.prefill_seq_lens_t = torch.tensor(self.prefill_seq_lens, dtype=torch.int32,
                                                   device=device)
        return (self.prefill_block_tables.contiguous(), self.prefill_query_start_loc,
                self.prefill_seq_lens_t)
