"""Flattened model inputs for one forward pass over paged sequences.

Both the model runner (the target model) and the draft proposer (a draft model on the same
block tables) build their batches here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from argosy_runtime.attention.metadata import AttentionMetadata

# One sequence's part of a batch: (its block ids, position of its first new token, new tokens)
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
    """
    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    decode_tables, decode_lens = [], []
    prefill_tables, q_lens, seq_lens = [], [], []
    for block_ids, start, tokens in entries:
        end = start + len(tokens)
        input_ids.extend(tokens)
        pos = np.arange(start, end)
        positions.append(pos)
        slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        if len(tokens) <= decode_rows_up_to:
            if prefill_tables:
                raise ValueError(f"entries of up to {decode_rows_up_to} tokens (decode rows) "
                                 "must come before longer ones")
            decode_tables.extend([block_ids] * len(tokens))
            decode_lens.extend(range(start + 1, end + 1))
        else:
            prefill_tables.append(block_ids)
            q_lens.append(len(tokens))
            seq_lens.append(end)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        num_decodes=len(decode_lens),
        decode_block_tables=_pad_tables(decode_tables, device),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
        prefill_query_lens=q_lens,
        prefill_seq_lens=seq_lens,
        prefill_block_tables=_pad_tables(prefill_tables, device),
        prefill_query_start_loc=torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32,
                                             device=device),
        prefill_seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
    return (
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.from_numpy(np.concatenate(positions)).to(device),
        meta,
    )


def _pad_tables(tables: list[np.ndarray], device: torch.device) -> torch.Tensor:
    if not tables:
        return torch.zeros((0, 1), dtype=torch.int32, device=device)
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return torch.from_numpy(out).to(device)
