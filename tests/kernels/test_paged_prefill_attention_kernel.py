"""paged_prefill_attention (Triton) against its reference, and the reference against
per-row float64 attention (each query row sees exactly the keys up to its own position)."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
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

# (num_heads, num_kv_heads, head_dim, block_size, [(query_len, seq_len), ...]):
# whole prompts, chunks after a cached prefix, a one-token chunk, a chunk ending exactly on a
# block boundary, chunks longer than one query tile; GQA 1/4/8.
CASES = [
    (4, 4, 64, 16, [(5, 5), (1, 17), (20, 40)]),
    (8, 2, 128, 32, [(32, 64), (3, 3)]),
    (8, 1, 64, 16, [(18, 18), (7, 23)]),
]


def _inputs(case, dtype, seed):
    num_heads, num_kv_heads, head_dim, block_size, seqs = case
    g = generator(seed)
    lens = [n for _, n in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    kc = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=g)
    vc = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=g)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    query = randn(starts[-1], num_heads, head_dim, dtype=dtype, gen=g)
    tables = random_block_tables(lens, block_size, num_blocks, g)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return query, kc, vc, tables, qsl, seq_lens, head_dim**-0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, dtype):
    query, kc, vc, tables, qsl, seq_lens, scale = _inputs(case, dtype, seed=DTYPES.index(dtype))
    out = torch.full_like(query, float("nan"))
    got = paged_prefill_attention(query, kc, vc, tables, qsl, seq_lens, scale, out=out)
    assert got is out
    want = paged_prefill_attention_ref(query, kc, vc, tables, qsl, seq_lens, scale)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("case", CASES)
def test_reference_is_causal_over_the_cached_prefix(case):
    query, kc, vc, tables, qsl, seq_lens, scale = _inputs(case, torch.float32, seed=9)
    got = paged_prefill_attention_ref(query, kc, vc, tables, qsl, seq_lens, scale)
    starts = qsl.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            k = dense_kv(kc, tables[s], visible)
            v = dense_kv(vc, tables[s], visible)
            want = naive_attention(query[starts[s] + i], k, v, scale)
            torch.testing.assert_close(got[starts[s] + i].double().cpu(), want.cpu(),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_cache(dtype):
    query, kc, vc, tables, qsl, seq_lens, scale = _inputs(CASES[0], dtype, seed=4)
    kq, ks = quantize_per_head_ref(kc)
    vq, vs = quantize_per_head_ref(vc)
    got = paged_prefill_attention(query, kq, vq, tables, qsl, seq_lens, scale, k_scale=ks,
                                  v_scale=vs, out=torch.full_like(query, float("nan")))
    want = paged_prefill_attention_ref(query, kq, vq, tables, qsl, seq_lens, scale,
                                       k_scale=ks, v_scale=vs)
    assert_close(got, want, dtype)
    full = paged_prefill_attention_ref(query, kc, vc, tables, qsl, seq_lens, scale)
    assert (want.float() - full.float()).abs().max() < 0.05


def test_explicit_max_query_len_and_empty_chunks():
    # A sequence with no query rows this step (q_len 0) is skipped; the grid comes from the
    # caller's max_query_len without a host sync.
    query, kc, vc, tables, qsl, seq_lens, scale = _inputs(CASES[2], torch.float32, seed=2)
    qsl0 = torch.tensor([0, 18, 18], dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(query[:18], kc, vc, tables, qsl0, seq_lens, scale,
                                  max_query_len=18, out=torch.full_like(query[:18], float("nan")))
    want = paged_prefill_attention_ref(query[:18], kc, vc, tables, qsl0, seq_lens, scale)
    assert_close(got, want, torch.float32)


def test_empty_batch():
    query, kc, vc, tables, qsl, seq_lens, scale = _inputs(CASES[0], torch.float32, seed=0)
    empty_qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(query[:0], kc, vc, tables[:0], empty_qsl, seq_lens[:0], scale)
    assert got.shape == (0, *query.shape[1:])
    assert paged_prefill_attention_ref(query[:0], kc, vc, tables[:0], empty_qsl, seq_lens[:0],
                                       scale).shape == got.shape


def test_rejects_bad_inputs():
    query, kc, vc, tables, qsl, seq_lens, scale = _inputs(CASES[0], torch.float32, seed=0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, kc, vc, tables, qsl[:-1], seq_lens, scale)
    with pytest.raises(ValueError, match="cache dtype"):
        paged_prefill_attention(query.half(), kc, vc, tables, qsl, seq_lens, scale)
    kq, ks = quantize_per_head_ref(kc)
    with pytest.raises(ValueError, match="float16"):  # float32 scales: the old layout
        paged_prefill_attention(query, kq, kq, tables, qsl, seq_lens, scale, k_scale=ks.float(),
                                v_scale=ks.float())
