"""w8a16_matmul / w4a16_matmul (Triton) against their references; the int4 packing layout."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.w4a16_matmul import (
    pack_int4,
    quantize_int4,
    unpack_int4,
    w4a16_dequantize_ref,
    w4a16_matmul,
    w4a16_matmul_ref,
)
from argosy_kernels.w8a16_matmul import w8a16_matmul, w8a16_matmul_ref
from kernel_test_utils import DEVICE, DTYPES, assert_close, generator, randn

# Tolerances scale with the reduction length; fp16/bf16 kernels round the dequantized weight
# tile to the activation dtype before the tensor-core dot.
MM_SCALE = 4.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(1, 40, 96, None), (20, 64, 128, 3),
                                                      (33, 16, 64, 1)])
def test_w8a16_matches_reference(dtype, m, n, k, split_k):
    g = generator(m + n)
    x = randn(m, k, dtype=dtype, gen=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(n, generator=g) * 0.02).to(dtype=dtype, device=DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = w8a16_matmul(x, w, scales, out=out, split_k=split_k)
    assert got is out
    want = w8a16_matmul_ref(x, w, scales)
    assert_close(got, want, dtype, scale=MM_SCALE)
    # The reference is the plain dequantized product.
    exact = x.double() @ (w.double() * scales.double()[:, None]).T
    assert_close(want, exact, dtype, scale=MM_SCALE)


def test_pack_int4_layout():
    # Nibble i of word (n, j) is w[n, i * K/8 + j].
    k = 32
    w = (torch.arange(2 * k) % 16).view(2, k)
    packed = pack_int4(w)
    assert packed.shape == (2, 4) and packed.dtype == torch.int32
    for n in range(2):
        for j in range(4):
            word = int(packed[n, j]) & 0xFFFFFFFF
            assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(w[n, i * 4 + j])
                                                                   for i in range(8)]
    g = generator(0)
    r = torch.randint(0, 16, (5, 64), generator=g)
    assert torch.equal(unpack_int4(pack_int4(r)).long(), r)
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), 16))


def test_quantize_int4_round_trip():
    g = generator(1)
    w = torch.randn(8, 256, generator=g)
    qw, s, z = quantize_int4(w, 64)
    deq = w4a16_dequantize_ref(qw, s, z, 64)
    step = s.repeat_interleave(64, 1)
    assert ((deq - w).abs() <= step * 0.5 + step * 1e-3).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "group_size", "split_k"),
    [
        (1, 40, 256, 32, None),  # decode-like M=1; each (nibble, tile) inside one group
        (20, 48, 384, 64, 2),  # groups straddle tiles (K/8 = 48 not a multiple of 64), split K
        (3, 32, 1024, 128, None),
    ],
)
def test_w4a16_matches_reference(dtype, m, n, k, group_size, split_k):
    g = generator(k + m)
    x = randn(m, k, dtype=dtype, gen=g)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g)).to(DEVICE)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02).to(dtype=dtype, device=DEVICE)
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).to(dtype=dtype, device=DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = w4a16_matmul(x, qweight, scales, zeros, group_size, out=out, split_k=split_k)
    assert got is out
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group_size)
    assert_close(got, want, dtype, scale=MM_SCALE)


def test_w4a16_reference_matches_unpacked_weights():
    g = generator(4)
    w_int = torch.randint(0, 16, (6, 64), generator=g)
    scales = torch.rand(6, 2, generator=g)
    zeros = torch.rand(6, 2, generator=g) * 15  # fractional zero points allowed
    x = torch.randn(3, 64, generator=g)
    dense = (w_int.double() - zeros.double().repeat_interleave(32, 1)) * \
        scales.double().repeat_interleave(32, 1)
    got = w4a16_matmul_ref(x, pack_int4(w_int), scales, zeros, 32)
    torch.testing.assert_close(got.double(), x.double() @ dense.T, atol=1e-4, rtol=1e-5)


def test_empty_and_bad_inputs():
    x = torch.zeros(0, 64, device=DEVICE)
    w = torch.zeros(8, 64, dtype=torch.int8, device=DEVICE)
    assert w8a16_matmul(x, w, torch.ones(8, device=DEVICE)).shape == (0, 8)
    qw = torch.zeros(8, 8, dtype=torch.int32, device=DEVICE)
    s = torch.ones(8, 2, device=DEVICE)
    assert w4a16_matmul(x, qw, s, s, 32).shape == (0, 8)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, qw, s, s, 24)
    with pytest.raises(ValueError, match="scales"):
        w8a16_matmul(x, w, torch.ones(4, device=DEVICE))
