"""GPTQ (Frantar et al., 2022) for load-time int4: quantize one weight column at a time and
push each column's rounding error onto the columns not yet quantized, weighted by the inverse
Hessian H = X^T X of the layer's calibration inputs, so the layer's *outputs* on real
activations move as little as possible (plain rounding only minimizes the weight error).

Act-order (columns by decreasing diag(H)) is used; groups are contiguous in that order, which
is exactly `Int4Weight.input_perm` (the layer permutes its input to match).
"""

from __future__ import annotations

import torch

from argosy_runtime.quantization.rtn import Int4Weight

_BLOCK = 128  # columns updated lazily together (the paper's "lazy batch" trick)


def gptq_quantize_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int,
                       damp: float = 0.01, act_order: bool = True) -> Int4Weight:
    """GPTQ int4 of `w` [N, K] given `hessian` [K, K] (sum of x x^T over calibration tokens)."""
    w = w.float().clone()
    n, k = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w = w[:, perm]
    h = h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k)
    # Upper Cholesky factor of H^-1: row i holds the update coefficients for column i.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    ng = -(-k // group_size)
    q = torch.zeros(n, ng * group_size)
    scales = torch.zeros(n, ng)
    lows = torch.zeros(n, ng)
    for b0 in range(0, k, _BLOCK):
        b1 = min(b0 + _BLOCK, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = col // group_size
            if col % group_size == 0:
                # The group's range from its columns as updated so far.
                end = min(col + group_size, k)
                cols = torch.cat([w1[:, i:], w[:, b1:end]], dim=1)[:, : end - col]
                lo, hi = cols.amin(dim=1), cols.amax(dim=1)
                scales[:, g] = ((hi - lo) / 15.0).clamp(min=1e-12)
                lows[:, g] = lo
            s, lo = scales[:, g], lows[:, g]
            x = w1[:, i]
            qi = torch.round((x - lo) / s).clamp(0, 15)
            q[:, col] = qi
            err = (x - (qi * s + lo)) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    if ng * group_size != k:
        q[:, k:] = 8  # padding, never multiplied by a non-zero input
    return Int4Weight(q.to(torch.uint8), scales, lows + 8 * scales, group_size, k,
                      perm if act_order else None)
