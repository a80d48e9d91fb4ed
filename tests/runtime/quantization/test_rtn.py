"""Round trips of the load-time quantizers, within the error each format guarantees."""

from __future__ import annotations

import pytest
import torch
from argosy_runtime.quantization.rtn import quantize_int4, quantize_int8


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, 3] = 0.9  # an outlier, as real checkpoints have
    return w


def test_int8_round_trip_within_half_step() -> None:
    w = _weights(96, 200)
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.q.shape == (96, 200) and q.scale.shape == (96,)
    # symmetric: the channel's largest magnitude maps to +-127
    assert torch.equal(q.q.abs().amax(dim=1), torch.full((96,), 127, dtype=torch.int8))
    err = (q.dequantize() - w).abs()
    assert torch.all(err <= q.scale[:, None] / 2 + 1e-7)
    rel = (q.dequantize() - w).norm() / w.norm()
    assert rel < 0.01


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("k", [256, 576])  # 576 = SmolLM2's hidden size, not a multiple of 128
def test_int4_round_trip_plain_rtn(group_size: int, k: int) -> None:
    w = _weights(64, k)
    q = quantize_int4(w, group_size, clip_search=False)
    ng = -(-k // group_size)
    assert q.q.shape == (64, ng * group_size) and q.scales.shape == (64, ng)
    assert int(q.q.max()) <= 15
    deq = q.dequantize()
    assert deq.shape == w.shape
    # plain min/max RTN: every weight within half a step of its group's scale
    step = q.scales.repeat_interleave(group_size, dim=1)[:, :k]
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6)
    # group extremes are representable exactly (min -> 0, max -> 15)
    groups = torch.nn.functional.pad(w, (0, ng * group_size - k), value=float("nan"))
    lo = groups.view(64, ng, group_size).nan_to_num(nan=1e9).amin(dim=2)
    assert torch.allclose((0 - 8) * q.scales + q.zeros, lo, atol=1e-6)


def test_int4_error_grows_with_group_size() -> None:
    w = _weights(128, 512, seed=1)
    errs = [(quantize_int4(w, g, clip_search=False).dequantize() - w).norm() / w.norm()
            for g in (32, 64, 128)]
    assert errs[0] < errs[1] < errs[2] < 0.2


def test_clip_search_lowers_the_error() -> None:
    # Heavy-tailed weights: shrinking the range trades a clipped outlier for finer steps.
    torch.manual_seed(2)
    w = torch.distributions.StudentT(2.0).sample((256, 512)) * 0.02
    plain = quantize_int4(w, 128, clip_search=False).dequantize()
    searched = quantize_int4(w, 128, clip_search=True).dequantize()
    err_plain = (plain - w).pow(2).sum()
    err_search = (searched - w).pow(2).sum()
    # never worse per group by construction; here clearly better overall
    assert err_search < 0.9 * err_plain
