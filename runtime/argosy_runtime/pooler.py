"""Turns the hidden states of embedding requests' prompt rows into their embeddings.

A prompt may take several steps (chunked prefill), so mean pooling keeps a running float32
sum on the request; a chunk that starts at position 0 starts it afresh (a preempted request is
recomputed from the start). Mean pooling needs every position's hidden state, so such a
request takes nothing from the prefix cache (scheduler `_prefix_lookup_limit`); last pooling
needs only the last position, which is always computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from argosy_runtime.scheduler import ScheduledRequest


def pool_embeddings(scheduled: list[ScheduledRequest], hidden: torch.Tensor
                    ) -> dict[str, list[float]]:
    """request_id -> embedding, for the embedding requests whose prompt ends this step.

    `hidden` holds the step's rows in the order of `scheduled`, `num_new_tokens` each."""
    out: dict[str, list[float]] = {}
    offset = 0
    for sr in scheduled:
        req = sr.request
        n = sr.num_new_tokens
        params = req.pooling
        if params is not None:
            rows = hidden[offset : offset + n]
            if params.pooling == "mean":
                if req.num_computed_tokens == 0 or req.pooled_sum is None:
                    req.pooled_sum = torch.zeros(hidden.shape[-1], dtype=torch.float32,
                                                 device=hidden.device)
                req.pooled_sum += rows.float().sum(dim=0)
            if sr.completes_sequence:
                if params.pooling == "mean":
                    vector = req.pooled_sum / req.num_prompt_tokens
                else:
                    vector = rows[-1].float()
                if params.normalize:
                    vector = F.normalize(vector, dim=0)
                out[req.request_id] = vector.cpu().tolist()
                req.pooled_sum = None
        offset += n
    return out
