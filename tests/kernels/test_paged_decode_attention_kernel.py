"""paged_decode_attention (Triton) against paged_decode_attention_ref, and the reference
against a token-by-token float64 computation."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from argosy_kernels.reshape_and_cache import quantize_per_head_ref
from kernel_test_utils import (
    DEVICE,
    DTYPES,
    assert_close,
    dense_kv,
    generator,
    naive_attention,
    randn,
    random_block_tables,
)

# (num_heads, num_kv_heads, head_dim, block_size, context_lens): GQA ratios 1/4/8, head dims
# 64/128, block sizes 16/32; context 1, ends exactly on a block boundary, last block partial,
# several kernel tiles.
CASES = [
    (4, 4, 64, 16, [1, 16, 37]),
    (8, 2, 128, 32, [64, 5, 33]),
    (8, 1, 64, 16, [100, 1]),
]


def _inputs(case, dtype, seed):
    num_heads, num_kv_heads, head_dim, block_size, lens = case
    g = generator(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=g)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=g)
    query = randn(len(lens), num_heads, head_dim, dtype=dtype, gen=g)
    tables = random_block_tables(lens, block_size, num_blocks, g)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return query, key_cache, value_cache, tables, context_lens, head_dim**-0.5


@pytest.mark.parametrize(
    ("dtype", "num_splits"),
    [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None), (torch.float16, 3)],
)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, dtype, num_splits):
    """num_splits=3: the split-context (flash-decoding) path and its combine kernel."""
    query, kc, vc, tables, lens, scale = _inputs(case, dtype, seed=DTYPES.index(dtype))
    out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
    got = paged_decode_attention(query, kc, vc, tables, lens, scale, out=out, num_splits=num_splits)
    assert got is out
    want = paged_decode_attention_ref(query, kc, vc, tables, lens, scale)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_token_by_token_attention(case):
    query, kc, vc, tables, lens, scale = _inputs(case, torch.float32, seed=7)
    got = paged_decode_attention_ref(query, kc, vc, tables, lens, scale)
    for s, n in enumerate(lens.tolist()):
        k = dense_kv(kc, tables[s], n)
        v = dense_kv(vc, tables[s], n)
        want = naive_attention(query[s], k, v, scale)
        torch.testing.assert_close(got[s].double().cpu(), want.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "num_splits"), [(torch.float16, 1), (torch.bfloat16, 2), (torch.float32, 1)]
)
def test_int8_cache(dtype, num_splits):
    case = (8, 2, 64, 16, [1, 16, 45])
    query, kc, vc, tables, lens, scale = _inputs(case, dtype, seed=3)
    kq, ks = quantize_per_head_ref(kc)
    vq, vs = quantize_per_head_ref(vc)
    assert ks.dtype == vs.dtype == torch.float16
    out = torch.full_like(query, float("nan"))
    got = paged_decode_attention(query, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs,
                                 out=out, num_splits=num_splits)
    want = paged_decode_attention_ref(query, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs)
    assert_close(got, want, dtype)
    # The reference dequantizes exactly like a token-by-token computation...
    for s, n in enumerate(lens.tolist()):
        k = dense_kv(kq, tables[s], n, ks)
        v = dense_kv(vq, tables[s], n, vs)
        exact = naive_attention(query[s].float(), k, v, scale)
        assert_close(want[s], exact, dtype)
    # ...and int8 stays close to attention over the unquantized cache.
    full = paged_decode_attention_ref(query, kc, vc, tables, lens, scale)
    assert (got.float() - full.float()).abs().max() < 0.05


def test_long_context_many_splits():
    case = (8, 1, 64, 16, [200, 17])
    query, kc, vc, tables, lens, scale = _inputs(case, torch.float32, seed=11)
    want = paged_decode_attention_ref(query, kc, vc, tables, lens, scale)
    for splits in (4, 13):  # most splits of the short sequence are empty: they weigh 0
        got = paged_decode_attention(query, kc, vc, tables, lens, scale, num_splits=splits)
        assert_close(got, want, torch.float32)


def test_empty_batch():
    query, kc, vc, tables, lens, scale = _inputs(CASES[0], torch.float32, seed=0)
    got = paged_decode_attention(query[:0], kc, vc, tables[:0], lens[:0], scale)
    assert got.shape == (0, *query.shape[1:])
    assert paged_decode_attention_ref(query[:0], kc, vc, tables[:0], lens[:0], scale).shape == got.shape


@pytest.mark.parametrize("num_splits", [1, 2])
def test_zero_length_sequence_gives_zeros(num_splits):
    # A padded CUDA-graph slot has context length 0: zeros, not NaN, and its neighbours intact.
    query, kc, vc, tables, lens, scale = _inputs((4, 2, 64, 16, [20, 20]), torch.float32, seed=5)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(query, kc, vc, tables, lens, scale, num_splits=num_splits,
                                 out=torch.full_like(query, float("nan")))
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = paged_decode_attention_ref(query[:1], kc, vc, tables[:1], lens[:1], scale)
    assert_close(got[:1], want, torch.float32)


def test_rejects_bad_inputs():
    query, kc, vc, tables, lens, scale = _inputs(CASES[1], torch.float16, seed=0)
    kq, ks = quantize_per_head_ref(kc)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(query, kq, kq, tables, lens, scale)
    with pytest.raises(ValueError, match="float16"):  # float32 scales: the old layout
        paged_decode_attention(query, kq, kq, tables, lens, scale, k_scale=ks.float(),
                               v_scale=ks.float())
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(query[..., :32], kc, vc, tables, lens, scale)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(query[:, :3], kc, vc, tables, lens, scale)



@pytest.mark.parametrize("num_splits", [1, 2])
def test_padded_slots_and_empty_contexts_do_not_leak(num_splits):
    """NaN/inf in the slots past each context (the rest of its last block, a spare table
    column's block) must not reach any output, and a context of length 0 gives zeros, in the
    reference and the kernel alike; both against token-by-token attention."""
    query, kc, vc, tables, _, scale = _inputs((8, 2, 64, 16, [20, 1, 33]), torch.float32, seed=9)
    lens = [20, 0, 33]  # the middle sequence owns a block but has no token in it (yet)
    block_size, width = kc.shape[1], tables.shape[1]
    used = {int(tables[s, t // block_size]) for s, n in enumerate([20, 1, 33]) for t in range(n)}
    spare = min(set(range(kc.shape[0])) - used)
    tables[0, 2:] = spare  # seq 0: 2 blocks, seq 1: 1, seq 2: 3; the rest of each row is spare
    tables[1, 1:] = spare
    tables[2, 3:] = spare
    kc[spare], vc[spare] = float("inf"), float("nan")
    for s, n in enumerate(lens):
        for t in range(n, width * block_size):
            kc[tables[s, t // block_size], t % block_size] = float("nan")
            vc[tables[s, t // block_size], t % block_size] = float("nan")
    want = torch.zeros(query.shape, dtype=torch.float64)
    for s in (0, 2):
        k, v = dense_kv(kc, tables[s], lens[s]), dense_kv(vc, tables[s], lens[s])
        want[s] = naive_attention(query[s], k, v, scale)
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = paged_decode_attention_ref(query, kc, vc, tables, lens, scale)
    torch.testing.assert_close(ref.double().cpu(), want, atol=1e-5, rtol=1e-5)
    got = paged_decode_attention(query, kc, vc, tables, lens, scale, num_splits=num_splits,
                                 out=torch.full_like(query, float("nan")))
    assert_close(got, want, torch.float32)
