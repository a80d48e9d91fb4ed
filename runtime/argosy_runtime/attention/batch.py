"""Flattened model inputs for one forward pass over paged sequences.

Both the model runner (the target model) and the draft proposer (a draft model on the same
block tables) build their batches here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from argosy_runtime.attention.metadata import AttentionMetadata

# One sequence's part of a batch: (its block ids, position of its first new token, new tokens).
# The block ids are one row per block table with a hybrid KV layout (kv_cache/layout.py).
BatchEntry = tuple[np.ndarray, int, Sequence[int]]


def decode_rows_first(lengths: Sequence[int], decode_rows_up_to: int = 1) -> list[int]:
    """Indices of entries with these token counts in the order build_batch needs: those that
    become decode rows first, each group in its given order."""
    return sorted(range(len(lengths)), key=lambda i: lengths[i] > decode_rows_up_to)


def build_batch(entries: Sequence[BatchEntry], block_size: int, device: torch.device,
                decode_rows_up_to: int = 1) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [num_tokens], positions [num_tokens], metadata), entries in the given order.

    Entries of up to `decode_rows_up_to` tokens become decode rows, one per token, each
    attending to its own prefix (a verification chunk of 1 + k tokens is then k + 1 decode
    queries on the same block table): every layer writes all new K/V before attention reads,
    so row i sees rows < i of its chunk. They must come first: attention treats the first
    `num_decodes` tokens as decode rows. The rows of the batch are the same either way.
    Entries with a block table per row give metadata per table (`table_metadata`).
    """
    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    decode_entries: list[int] = []  # per decode row, its entry
    prefill_entries: list[int] = []
    decode_lens, q_lens, seq_lens = [], [], []
    for i, (_, start, tokens) in enumerate(entries):
        end = start + len(tokens)
        input_ids.extend(tokens)
        positions.append(np.arange(start, end))
        if len(tokens) <= decode_rows_up_to:
            if q_lens:
                raise ValueError(f"entries of up to {decode_rows_up_to} tokens (decode rows) "
                                 "must come before longer ones")
            decode_entries.extend([i] * len(tokens))
            decode_lens.extend(range(start + 1, end + 1))
        else:
            prefill_entries.append(i)
            q_lens.append(len(tokens))
            seq_lens.append(end)
    # Every entry's block ids in one [tables, entries, blocks] array (zero-padded): slots
    # and the decode and prefill tables are then gathers from it, for every table at once.
    block_ids = [np.asarray(ids) for ids, _, _ in entries]
    widths = [ids.shape[-1] for ids in block_ids]
    num_tables = block_ids[0].shape[0] if block_ids and block_ids[0].ndim == 2 else 1
    padded = np.zeros((num_tables, len(entries), max(widths, default=1)), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        padded[:, i, : widths[i]] = ids
    pos = np.concatenate(positions)
    token_entries = np.repeat(np.arange(len(entries)), [len(t) for _, _, t in entries])
    short = pos // block_size >= np.asarray(widths)[token_entries]
    if short.any():  # its slots would come from the zero padding
        i = int(token_entries[short.argmax()])
        raise ValueError(f"entry {i}: {widths[i]} blocks cannot hold positions up to "
                         f"{int(positions[i][-1])}")
    slots = padded[:, token_entries, pos // block_size] * block_size + pos % block_size
    decode_width = max((widths[i] for i in decode_entries), default=1)
    prefill_width = max((widths[i] for i in prefill_entries), default=1)
    # Contiguous: numpy may lay out a gather's result in another order, and kernels take
    # each table's rows as contiguous tensors.
    slot_mapping = torch.from_numpy(np.ascontiguousarray(slots)).to(device)
    decode_tables = torch.from_numpy(np.ascontiguousarray(
        padded[:, decode_entries, :decode_width], dtype=np.int32)).to(device)
    prefill_tables = torch.from_numpy(np.ascontiguousarray(
        padded[:, prefill_entries, :prefill_width], dtype=np.int32)).to(device)
    # The lengths are the same for every table.
    decode_context_lens = torch.tensor(decode_lens, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata.of_tables([AttentionMetadata(
        slot_mapping=slot_mapping[t],
        num_decodes=len(decode_lens),
        decode_block_tables=decode_tables[t],
        decode_context_lens=decode_context_lens,
        prefill_query_lens=q_lens,
        prefill_seq_lens=seq_lens,
        prefill_block_tables=prefill_tables[t],
        prefill_query_start_loc=query_start_loc,
        prefill_seq_lens_t=seq_lens_t,
    ) for t in range(num_tables)])
    input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=device)
    return input_ids_t, torch.from_numpy(pos).to(device), meta
