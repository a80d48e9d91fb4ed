"""Verification of draft tokens against the target distribution.

Greedy: accept while the draft equals the target argmax; the first mismatch is replaced by
the target's token, and when all k match the bonus position adds one more.
Sampled: accept draft x with probability min(1, p(x) / q(x)); on rejection sample from the
normalized residual max(0, p - q). This is exactly the target distribution p (Leviathan et
al., 2023; Chen et al., 2023). A deterministic proposer (n-gram) has q = one-hot(x): there
rejection sampling is the same as drawing the target's token at each position and keeping the
draft while it equals the draw (accepted with probability p(x), else a draw from p without x),
which draws exactly what plain decoding draws, so a seeded request gets the same tokens with
and without speculation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def verify_sampled(
    target_probs: Callable[[int, list[int]], torch.Tensor],  # (position, accepted so far) -> [vocab]
    draft_tokens: list[int],  # k tokens
    draft_probs: torch.Tensor | None,  # [k, vocab] proposal distributions, None = one-hot
    uniform: Callable[[], float],
    sample: Callable[[torch.Tensor], int],  # draws one token from an unnormalized [vocab] row
) -> list[int]:
    """Returns the accepted draft prefix plus one target-distributed token. `sample` gets
    target_probs' rows as they are (as plain decoding's sampler does) for one-hot drafts."""
    out: list[int] = []
    if draft_probs is None:  # one-hot q: the plain decoding draws (module doc)
        for i, x in enumerate(draft_tokens):
            out.append(sample(target_probs(i, out)))
            if out[-1] != x:
                return out
        out.append(sample(target_probs(len(draft_tokens), out)))
        return out
    for i, x in enumerate(draft_tokens):
        p = target_probs(i, out)
        p = p / p.sum()
        q_x = float(draft_probs[i, x])
        p_x = float(p[x])
        if q_x > 0 and uniform() < min(1.0, p_x / q_x):
            out.append(x)
            continue
        residual = torch.clamp(p - draft_probs[i] / draft_probs[i].sum(), min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any draw from p is right
            residual = p
        out.append(sample(residual))
        return out
    out.append(sample(target_probs(len(draft_tokens), out)))
    return out
