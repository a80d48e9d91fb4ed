"""oneDNN-prepacked bf16 linears give the same outputs as F.linear."""

from __future__ import annotations

import pytest
import torch
from argosy_runtime.models.cpu_linear import PackedLinear, pack_linears_for_cpu
from torch import nn


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_plain_linear(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(200, generator=gen))
    packed = PackedLinear(linear)
    for tokens in (1, 3, 32, 129):
        x = torch.randn(tokens, 96, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(packed(x), linear(x), rtol=1.6e-2, atol=1e-2)


def test_only_plain_bf16_linears_are_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8),  # float32 stays
                          nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16)))
    expected = 2 if torch.backends.mkldnn.is_available() else 0
    assert pack_linears_for_cpu(model) == expected
    assert type(model[1]) is nn.Linear
    if expected:
        assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
def test_tied_weight_is_packed_as_a_copy_and_the_embedding_keeps_its_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    embed = nn.Embedding(10, 8).to(torch.bfloat16)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(10, 8, generator=gen))
    head = nn.Linear(8, 10, bias=False).to(torch.bfloat16)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    x = torch.randn(3, 8, generator=gen).to(torch.bfloat16)
    expected = head(x)
    assert pack_linears_for_cpu(model) == 1
    assert isinstance(model["head"], PackedLinear)
    assert model["embed"].weight is embed.weight  # lookups still read the plain rows
    torch.testing.assert_close(model["head"](x), expected, rtol=1.6e-2, atol=1e-2)
