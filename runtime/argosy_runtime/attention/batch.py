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


def build_batch(entries: Sequence[BatchEntry], block_size: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [num_tokens], positions [num_tokens], metadata), entries in the given order.

    Entries with a single token must come first: attention treats the first `num_decodes`
    tokens as one-token sequences.
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
        if len(tokens) == 1:
            if prefill_tables:
                raise ValueError("single-token entries must come before multi-token ones")
            decode_tables.append(block_ids)
            decode_lens.append(end)
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
