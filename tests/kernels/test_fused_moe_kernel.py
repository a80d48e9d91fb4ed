"""fused_moe (the MoE experts as two grouped GEMMs) against its expert-by-expert torch
reference, and the pair alignment it stands on."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.fused_moe import align_pairs_by_expert, fused_moe, fused_moe_ref
from kernel_test_utils import DEVICE, DTYPES, assert_close, generator, randn


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator,
             weight_dtype: torch.dtype):
    probs = torch.randn(tokens, experts, generator=gen).softmax(-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights.to(device=DEVICE, dtype=weight_dtype), ids.to(DEVICE)


# (tokens, experts, top_k, hidden, inter): a decode row; pairs ending exactly on a 16-row
# block (8 x 2); some experts unused; top_k 1 and 4; enough pairs for the 64-row blocks
# (> 16 per expert); sizes that are no multiple of the 32-wide tiles.
SHAPES = [(1, 8, 2, 64, 96), (8, 4, 2, 64, 64), (3, 16, 4, 48, 80), (5, 4, 1, 32, 48),
          (70, 4, 2, 32, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_moe_matches_reference(dtype, shape):
    tokens, experts, top_k, hidden, inter = shape
    gen = generator(hash(shape) % 1000)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, gen=gen) * hidden**-0.5
    w2 = randn(experts, hidden, inter, dtype=dtype, gen=gen) * inter**-0.5
    # Mixtral keeps routing weights in float32, Qwen MoE casts them to the model dtype.
    for weight_dtype in {torch.float32, dtype}:
        weights, ids = _routing(tokens, experts, top_k, gen, weight_dtype)
        out = torch.full_like(x, float("nan"))  # poisoned: a row left unwritten fails
        got = fused_moe(x, w13, w2, weights, ids, out=out)
        assert got is out
        # Two roundings to the dtype (after each GEMM) where the reference has one.
        assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), dtype, scale=2.0)


def test_fused_moe_empty_batch():
    x = torch.empty(0, 32, device=DEVICE)
    w13, w2 = torch.zeros(4, 64, 32, device=DEVICE), torch.zeros(4, 32, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.long, device=DEVICE)
    assert fused_moe(x, w13, w2, ids.float(), ids).shape == (0, 32)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_pairs_groups_every_pair_once_in_whole_blocks(block_m):
    gen = generator(7)
    for tokens, experts, top_k in [(1, 8, 2), (8, 4, 2), (33, 8, 3), (100, 3, 1)]:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                           for _ in range(tokens)])
        pairs = tokens * top_k
        sorted_pairs, block_experts, num_padded = align_pairs_by_expert(ids, experts, block_m)
        assert sorted_pairs.numel() == block_experts.numel() * block_m
        end = int(num_padded)
        counts = torch.bincount(ids.flatten(), minlength=experts)
        assert end == int(((counts + block_m - 1) // block_m * block_m).sum())
        real = sorted_pairs[:end]
        assert sorted(real[real < pairs].tolist()) == list(range(pairs))  # each pair once
        assert (sorted_pairs[end:] == pairs).all()  # past the end: only padding
        flat = ids.flatten()
        for b in range(end // block_m):
            block = real[b * block_m:(b + 1) * block_m]
            block = block[block < pairs].long()
            assert block.numel() > 0  # no block is padding alone
            assert (flat[block] == block_experts[b]).all()  # one expert per block
            assert (block.diff() > 0).all()  # in token order within the expert


def test_fused_moe_refuses_mismatched_shapes():
    x = torch.zeros(2, 32, device=DEVICE)
    w13, w2 = torch.zeros(4, 64, 32, device=DEVICE), torch.zeros(4, 32, 32, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(x, w13, torch.zeros(4, 32, 16, device=DEVICE), ids.float(), ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, w13, w2, ids.float()[:1], ids)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, ids.float(), ids)
