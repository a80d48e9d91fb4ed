"""silu_and_mul (Triton) against silu_and_mul_ref, and the reference against the formula."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from kernel_test_utils import DEVICE, DTYPES, assert_close, generator, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (5, 1536), (3, 2500)])
def test_kernel_matches_reference(dtype, tokens, inter):
    # 1536: SmolLM2-135M's intermediate size; 2500: not a multiple of the kernel's block.
    g = generator(tokens + inter)
    gate_up = randn(tokens, 2 * inter, dtype=dtype, gen=g) * 4
    out = torch.full((tokens, inter), float("nan"), dtype=dtype, device=DEVICE)
    got = silu_and_mul(gate_up, out=out)
    assert got is out
    assert_close(got, silu_and_mul_ref(gate_up), dtype)


def test_strided_rows():
    # Rows of a wider buffer (what a padded batch hands over): strides are honoured.
    g = generator(1)
    wide = randn(4, 2 * 96 + 32, dtype=torch.float32, gen=g)
    gate_up = wide[:, : 2 * 96]
    assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), torch.float32)


def test_reference_formula():
    g = generator(2)
    x = torch.randn(3, 40, generator=g, dtype=torch.float64)
    gate, up = x[:, :20], x[:, 20:]
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x.float()).double(), want, atol=1e-6, rtol=1e-6)


def test_empty_and_bad_inputs():
    assert silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.ones(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(torch.ones(2, 8, device=DEVICE), out=torch.empty(2, 3, device=DEVICE))
