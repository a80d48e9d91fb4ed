"""sentence-transformers' Pooling module, the reference side of the pooling tests:
`st_pool(token_embeddings, attention_mask, mode)` computes what
`sentence_transformers.models.Pooling(pooling_mode=mode).forward` puts in
`sentence_embedding` (sentence-transformers is not installed here: these are its documented
formulas, written out from its source, padding masked the way it masks it).
"""

from __future__ import annotations

import torch

# PoolingParams.pooling -> sentence-transformers' pooling_mode (and its config key).
ST_MODES = {"cls": ("cls", "pooling_mode_cls_token"),
            "mean": ("mean", "pooling_mode_mean_tokens"),
            "max": ("max", "pooling_mode_max_tokens"),
            "mean_sqrt_len_tokens": ("mean_sqrt_len_tokens", "pooling_mode_mean_sqrt_len_tokens"),
            "weightedmean": ("weightedmean", "pooling_mode_weightedmean_tokens"),
            "last": ("lasttoken", "pooling_mode_lasttoken")}


def st_pool(token_embeddings: torch.Tensor, attention_mask: torch.Tensor, mode: str
            ) -> torch.Tensor:
    """[batch, seq, hidden] states, [batch, seq] 0/1 mask -> [batch, hidden], for one
    sentence-transformers pooling_mode ("cls", "lasttoken", "max", "mean",
    "mean_sqrt_len_tokens", "weightedmean")."""
    x = token_embeddings.clone()
    mask = attention_mask.unsqueeze(-1).expand(x.size()).to(x.dtype)
    if mode == "cls":
        return x[:, 0]
    if mode == "max":
        x[mask == 0] = -1e9  # padding never wins
        return torch.max(x, 1)[0]
    if mode in ("mean", "mean_sqrt_len_tokens"):
        total = torch.sum(x * mask, 1)
        count = torch.clamp(mask.sum(1), min=1e-9)
        return total / count if mode == "mean" else total / torch.sqrt(count)
    if mode == "weightedmean":  # token i (from 0) weighs i + 1
        weights = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None].expand(x.size())
        mask = mask * weights
        return torch.sum(x * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
    if mode == "lasttoken":
        values, indices = attention_mask.flip(1).max(1)
        indices = torch.where(values == 0, x.shape[1] - 1, indices)
        last = x.shape[1] - indices - 1  # [batch]
        return (x * mask)[torch.arange(x.shape[0]), last]
    raise ValueError(f"unknown sentence-transformers pooling mode {mode!r}")
