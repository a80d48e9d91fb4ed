"""rotary_embedding (Triton, in place) against its reference; the reference against complex
rotation."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.rotary_embedding import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)
from kernel_test_utils import DEVICE, DTYPES, assert_close, generator, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (48, 32)])  # full and partial
def test_kernel_matches_reference(dtype, is_neox, head_dim, rot_dim):
    g = generator(head_dim + is_neox)
    cache = build_cos_sin_cache(rot_dim, 128, device=DEVICE)
    positions = torch.randint(0, 128, (6,), generator=g).to(DEVICE)
    # q and k as views of one fused qkv projection (strided, as the model produces them).
    qkv = randn(6, (4 + 2 + 2) * head_dim, dtype=dtype, gen=g)
    q = qkv[:, : 4 * head_dim].view(6, 4, head_dim)
    k = qkv[:, 4 * head_dim: 6 * head_dim].view(6, 2, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    before = qkv.clone()
    rotary_embedding(positions, q, k, cache, is_neox)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, is_neox)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    # Values, the un-rotated tail of each head, and nothing else changed.
    assert torch.equal(qkv[:, 6 * head_dim:], before[:, 6 * head_dim:])
    assert torch.equal(q[..., rot_dim:], before[:, : 4 * head_dim].view(6, 4, head_dim)[..., rot_dim:])


@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_is_a_complex_rotation(is_neox):
    g = generator(1)
    rot_dim, base = 16, 10000.0
    cache = build_cos_sin_cache(rot_dim, 50, base, device=DEVICE)
    x = torch.randn(3, 2, rot_dim, generator=g).to(DEVICE)
    pos = torch.tensor([0, 7, 49], device=DEVICE)
    y = x.clone()
    rotary_embedding_ref(pos, y, None, cache, is_neox)
    half = rot_dim // 2
    if is_neox:
        z = torch.complex(x[..., :half].double(), x[..., half:].double())
    else:
        z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())
    theta = pos.double()[:, None] * base ** (-torch.arange(0, rot_dim, 2, device=DEVICE).double()
                                             / rot_dim)
    z = z * torch.polar(torch.ones_like(theta), theta)[:, None, :]
    want = torch.cat([z.real, z.imag], -1) if is_neox else torch.stack([z.real, z.imag], -1).flatten(-2)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[0], x[0])  # position 0 is the identity


def test_empty_and_bad_inputs():
    cache = build_cos_sin_cache(16, 8, device=DEVICE)
    q = torch.zeros(0, 2, 16, device=DEVICE)
    rotary_embedding(torch.zeros(0, dtype=torch.long, device=DEVICE), q, None, cache)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_embedding(torch.zeros(1, dtype=torch.long, device=DEVICE),
                         torch.zeros(1, 2, 8, device=DEVICE), None, cache)
