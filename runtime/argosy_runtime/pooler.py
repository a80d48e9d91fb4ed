"""Turns the hidden states of pooling requests' prompt rows into their output vectors.

An embedding request (task "embed") gets its pooled hidden state. A prompt may take several
steps (chunked prefill), so the poolings over every token (mean, max, mean_sqrt_len_tokens,
weightedmean: sentence-transformers' formulas, pooling_params.py) keep a running float32 sum
or maximum on the request (`pooled_state`); a chunk that starts at position 0 starts it afresh
(a preempted request is recomputed from the start). They need every position's hidden state,
so such a request takes nothing from the prefix cache (scheduler `_prefix_lookup_limit`);
last pooling needs only the last position, which is always computed. "cls" pooling
(encoders, models/bert.py) takes the first row: an encoder runs each prompt whole in one
step.

A classify request (task "classify") gets the classification head's logits at its last
position: the rows of every such request ending this step go through the head together.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from argosy_runtime.pooling_params import WHOLE_PROMPT_POOLINGS
from argosy_runtime.request import Request
from argosy_runtime.scheduler import ScheduledRequest


def pool_outputs(scheduled: list[ScheduledRequest], hidden: torch.Tensor,
                 classify_head: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> dict[str, list[float]]:
    """request_id -> output vector, for the pooling requests whose prompt ends this step: an
    embedding, or a classify request's head logits (`classify_head`: [n, hidden] -> [n,
    num_labels] float32; the model's `compute_class_logits`).

    `hidden` holds the step's rows in the order of `scheduled`, `num_new_tokens` each."""
    out: dict[str, list[float]] = {}
    classify: list[tuple[str, int]] = []  # (request id, its last row in `hidden`)
    offset = 0
    for sr in scheduled:
        req = sr.request
        n = sr.num_new_tokens
        params = req.pooling
        if params is not None and params.task == "classify":
            if sr.completes_sequence:  # an encoder's head reads [CLS] (its prompt is whole)
                classify.append((req.request_id,
                                 offset if params.pooling == "cls" else offset + n - 1))
        elif params is not None:
            rows = hidden[offset : offset + n]
            if params.pooling in WHOLE_PROMPT_POOLINGS:
                _accumulate(req, params.pooling, rows)
            if sr.completes_sequence:
                if params.pooling in WHOLE_PROMPT_POOLINGS:
                    vector = _finish(req.pooled_state, params.pooling, req.num_prompt_tokens)
                elif params.pooling == "cls":  # an encoder's: the prompt ran whole this step
                    vector = rows[0].float()
                else:
                    vector = rows[-1].float()
                if params.dimensions is not None:  # Matryoshka: the leading values
                    vector = vector[: params.dimensions]
                if params.normalize:
                    vector = F.normalize(vector, dim=0)
                out[req.request_id] = vector.cpu().tolist()
                req.pooled_state = None
        offset += n
    if classify:
        if classify_head is None:
            raise RuntimeError("classify requests need the model's classification head")
        rows = torch.tensor([row for _, row in classify], device=hidden.device)
        logits = classify_head(hidden[rows]).cpu()  # [num_classify, num_labels]
        for i, (request_id, _) in enumerate(classify):
            out[request_id] = logits[i].tolist()
    return out


def _accumulate(req: Request, pooling: str, rows: torch.Tensor) -> None:
    """Fold this chunk's rows [n, hidden] (prompt positions num_computed_tokens ...) into the
    request's running float32 state: the maximum for "max", else the (weighted) sum."""
    rows = rows.float()
    first = req.num_computed_tokens
    if first == 0 or req.pooled_state is None:
        fill = float("-inf") if pooling == "max" else 0.0
        req.pooled_state = torch.full((rows.shape[-1],), fill, dtype=torch.float32,
                                      device=rows.device)
    if pooling == "max":
        torch.maximum(req.pooled_state, rows.amax(dim=0), out=req.pooled_state)
    elif pooling == "weightedmean":  # position p weighs p + 1 (sentence-transformers' arange)
        weights = torch.arange(first + 1, first + rows.shape[0] + 1, dtype=torch.float32,
                               device=rows.device)
        req.pooled_state += weights @ rows
    else:
        req.pooled_state += rows.sum(dim=0)


def _finish(state: torch.Tensor, pooling: str, num_tokens: int) -> torch.Tensor:
    """The pooled vector from the running state of all `num_tokens` prompt positions."""
    if pooling == "max":
        return state
    if pooling == "mean":
        return state / num_tokens
    if pooling == "mean_sqrt_len_tokens":
        return state / math.sqrt(num_tokens)
    return state / (num_tokens * (num_tokens + 1) / 2)  # weightedmean: the sum of 1..n
