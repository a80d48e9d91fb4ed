"""rms_norm (Triton) against rms_norm_ref, and the reference against the textbook formula."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.rms_norm import rms_norm, rms_norm_ref
from kernel_test_utils import DEVICE, DTYPES, assert_close, generator, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])  # 576: SmolLM2-135M, not a power of two
def test_kernel_matches_reference(dtype, hidden):
    g = generator(hidden)
    x = randn(7, hidden, dtype=dtype, gen=g)
    w = randn(hidden, dtype=dtype, gen=g)
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, w, 1e-5, out=out)
    assert got is out
    assert_close(got, rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual(dtype):
    g = generator(2)
    x = randn(5, 96, dtype=dtype, gen=g)
    w = randn(96, dtype=dtype, gen=g)
    residual = randn(5, 96, dtype=dtype, gen=g)
    r_kernel, r_ref = residual.clone(), residual.clone()
    out, r_out = rms_norm(x, w, 1e-6, r_kernel, out=torch.full_like(x, float("nan")))
    want, r_want = rms_norm_ref(x, w, 1e-6, r_ref)
    assert r_out is r_kernel  # updated in place
    assert_close(r_kernel, x.float() + residual.float(), dtype)
    assert_close(r_kernel, r_want, dtype)
    assert_close(out, want, dtype)


def test_reference_formula():
    g = generator(3)
    x = torch.randn(4, 32, generator=g, dtype=torch.float64).to(DEVICE)
    w = torch.randn(32, generator=g, dtype=torch.float64).to(DEVICE)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 32 + 1e-6) * w
    torch.testing.assert_close(rms_norm_ref(x.float(), w.float(), 1e-6).double(), want,
                               atol=1e-5, rtol=1e-5)
    r = torch.randn(4, 32, generator=g, dtype=torch.float64).to(DEVICE)
    r_f = r.float().clone()
    out, _ = rms_norm_ref(x.float(), w.float(), 1e-6, r_f)
    h = x + r
    torch.testing.assert_close(r_f.double(), h, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        out.double(), h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w,
        atol=1e-5, rtol=1e-5)


def test_empty_and_bad_inputs():
    w = torch.ones(8, device=DEVICE)
    assert rms_norm(torch.empty(0, 8, device=DEVICE), w, 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
