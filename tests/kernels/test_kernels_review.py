"""Edge shapes the per-kernel tests do not reach, each kernel against its torch reference on
fresh random inputs: head dims 80/96/256, GQA groups that are no power of two or above 8,
block sizes of 1, 8 and 24, a long context over small blocks, K that no tile divides; and the
launchers' refusals of inputs they would otherwise read out of bounds or misread. Shapes are
small: everything runs under Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.fused_moe import fused_moe
from argosy_kernels.matmul_config import MatmulConfig
from argosy_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from argosy_kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from argosy_kernels.reshape_and_cache import (
    quantize_per_head_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from argosy_kernels.rms_norm import rms_norm, rms_norm_ref
from argosy_kernels.rotary_embedding import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)
from argosy_kernels.w4a16_matmul import quantize_int4, w4a16_matmul, w4a16_matmul_ref
from argosy_kernels.w8a16_matmul import w8a16_matmul, w8a16_matmul_ref
from kernel_test_utils import DEVICE, assert_close, generator, randn, random_block_tables


def _cache(num_heads, num_kv_heads, head_dim, block_size, lens, dtype, int8, gen):
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    kc = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    vc = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    tables = random_block_tables(lens, block_size, num_blocks, gen)
    scales = {}
    if int8:
        kc, ks = quantize_per_head_ref(kc)
        vc, vs = quantize_per_head_ref(vc)
        scales = {"k_scale": ks, "v_scale": vs}
    return kc, vc, tables, scales


# (num_heads, num_kv_heads, head_dim, block_size, context_lens): head dims 80/96/256 (padded to
# a power of two inside the kernel); GQA 3 and 16; block size 1, 8 (a long context of 38
# blocks) and 24 (no power of two); contexts of 1, at and one past a block boundary.
DECODE_CASES = [
    (4, 4, 80, 16, [1, 16, 17]),
    (4, 2, 96, 16, [32, 33]),
    (2, 1, 256, 16, [17]),
    (12, 4, 64, 16, [31, 2]),
    (16, 1, 64, 8, [300]),
    (4, 2, 64, 1, [20, 3]),
    (4, 2, 64, 24, [48, 49]),
]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.float16, True)])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_edge_shapes(case, dtype, int8, num_splits):
    num_heads, num_kv_heads, head_dim, block_size, lens = case
    gen = generator(len(lens) * head_dim + block_size)
    kc, vc, tables, scales = _cache(*case, dtype, int8, gen)
    query = randn(len(lens), num_heads, head_dim, dtype=dtype, gen=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(query, kc, vc, tables, context_lens, head_dim**-0.5,
                                 num_splits=num_splits, out=torch.full_like(query, float("nan")),
                                 **scales)
    want = paged_decode_attention_ref(query, kc, vc, tables, context_lens, head_dim**-0.5,
                                      **scales)
    assert_close(got, want, dtype)


# (num_heads, num_kv_heads, head_dim, block_size, [(query_len, seq_len), ...]): chunks of one
# row, of one past a query tile (16 rows under the interpreter), ending one past a block.
PREFILL_CASES = [
    (4, 4, 80, 16, [(17, 17), (1, 33)]),
    (4, 2, 96, 16, [(16, 32), (3, 17)]),
    (2, 1, 256, 16, [(17, 18)]),
    (12, 4, 64, 16, [(20, 20), (1, 1)]),
    (16, 1, 64, 8, [(3, 200)]),
    (4, 2, 64, 24, [(25, 49)]),
]


@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.float16, True)])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_edge_shapes(case, dtype, int8):
    num_heads, num_kv_heads, head_dim, block_size, seqs = case
    gen = generator(len(seqs) * head_dim + block_size)
    lens = [n for _, n in seqs]
    kc, vc, tables, scales = _cache(num_heads, num_kv_heads, head_dim, block_size, lens, dtype,
                                    int8, gen)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    query = randn(starts[-1], num_heads, head_dim, dtype=dtype, gen=gen)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(query, kc, vc, tables, qsl, seq_lens, head_dim**-0.5,
                                  out=torch.full_like(query, float("nan")), **scales)
    want = paged_prefill_attention_ref(query, kc, vc, tables, qsl, seq_lens, head_dim**-0.5,
                                       **scales)
    assert_close(got, want, dtype)


def test_attention_with_a_permuted_query_writes_a_row_major_output():
    """A query that is dense but not row-major (here [heads, head_dim, tokens] permuted to
    [tokens, heads, head_dim]) was copied to row-major for the kernel, but the output was
    `empty_like(query)`, which keeps the permuted strides: the kernel, writing head_dim with a
    unit stride, scattered the result over other tokens' elements."""
    gen = generator(1)
    kc, vc, tables, _ = _cache(4, 2, 64, 16, [5, 16, 1], torch.float32, False, gen)
    query = randn(4, 64, 3, dtype=torch.float32, gen=gen).permute(2, 0, 1)  # [3, 4, 64]
    lens = torch.tensor([5, 16, 1], dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(query, kc, vc, tables, lens, 0.125)
    assert_close(got, paged_decode_attention_ref(query, kc, vc, tables, lens, 0.125),
                 torch.float32)

    query = randn(4, 64, 7, dtype=torch.float32, gen=gen).permute(2, 0, 1)  # [7, 4, 64]
    qsl = torch.tensor([0, 2, 7], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([2, 16], dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(query, kc, vc, tables[:2], qsl, seq_lens, 0.125)
    want = paged_prefill_attention_ref(query, kc, vc, tables[:2], qsl, seq_lens, 0.125)
    assert_close(got, want, torch.float32)


def test_rms_norm_of_a_transposed_input():
    """The same `empty_like` layout bug as the attention launchers, in rms_norm."""
    gen = generator(2)
    x = randn(96, 5, dtype=torch.float32, gen=gen).t()  # [5, 96], stride (1, 5)
    weight = randn(96, dtype=torch.float32, gen=gen)
    assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), torch.float32)
    residual = randn(5, 96, dtype=torch.float32, gen=gen)
    res_ref = residual.clone()
    out, _ = rms_norm(x, weight, 1e-6, residual)
    want, _ = rms_norm_ref(x, weight, 1e-6, res_ref)
    assert_close(out, want, torch.float32)
    assert torch.equal(residual, res_ref)


@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 576), (3, 1000), (2, 1)])
def test_rms_norm_hidden_no_power_of_two(num_tokens, hidden):
    gen = generator(hidden)
    x = randn(num_tokens, hidden, dtype=torch.float16, gen=gen)
    weight = randn(hidden, dtype=torch.float16, gen=gen)
    residual = randn(num_tokens, hidden, dtype=torch.float16, gen=gen)
    res_ref = residual.clone()
    out, _ = rms_norm(x, weight, 1e-6, residual)
    want, _ = rms_norm_ref(x, weight, 1e-6, res_ref)
    assert_close(out, want, torch.float16)
    assert torch.equal(residual, res_ref)


@pytest.mark.parametrize(("head_dim", "rot_dim", "is_neox"),
                         [(80, 80, True), (96, 32, False), (256, 256, True)])
def test_rotary_head_dims(head_dim, rot_dim, is_neox):
    """rot_dim / 2 of 40 or 16 and 128 (no power of two, or the largest head)."""
    gen = generator(head_dim)
    cos_sin = build_cos_sin_cache(rot_dim, 50, device=DEVICE)
    positions = torch.tensor([0, 49, 17], device=DEVICE)
    query = randn(3, 3, head_dim, dtype=torch.float32, gen=gen)
    key = randn(3, 1, head_dim, dtype=torch.float32, gen=gen)
    q_ref, k_ref = query.clone(), key.clone()
    rotary_embedding(positions, query, key, cos_sin, is_neox)
    rotary_embedding_ref(positions, q_ref, k_ref, cos_sin, is_neox)
    assert_close(query, q_ref, torch.float32)
    assert_close(key, k_ref, torch.float32)


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(3, 80), (1, 96), (2, 256)])
def test_reshape_and_cache_int8_head_dims(num_kv_heads, head_dim):
    """Heads and head dims padded inside the kernel; slots at and one past a block boundary,
    the cache's last slot, a padded token."""
    gen = generator(head_dim)
    key = randn(5, num_kv_heads, head_dim, dtype=torch.float16, gen=gen)
    value = randn(5, num_kv_heads, head_dim, dtype=torch.float16, gen=gen)
    kc = torch.full((4, 16, num_kv_heads, head_dim), -128, dtype=torch.int8, device=DEVICE)
    vc = kc.clone()
    ks = torch.zeros(4, 16, num_kv_heads, dtype=torch.float16, device=DEVICE)
    vs = ks.clone()
    refs = [t.clone() for t in (kc, vc, ks, vs)]
    slots = torch.tensor([0, 15, 16, -1, 63], device=DEVICE)
    reshape_and_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs)
    reshape_and_cache_ref(key, value, refs[0], refs[1], slots, k_scale=refs[2], v_scale=refs[3])
    for got, want in zip((kc, vc, ks, vs), refs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 13, 100, None),  # the one-row FMA kernel, K no multiple of its 64-wide tile
        (17, 33, 70, None),  # one row past a 16-row tile, K no multiple of 32
        (1, 20, 300, MatmulConfig(1, 8, 64, num_warps=1, use_dot=False, split_k=4)),
    ],
    ids=str,
)
def test_w8a16_k_not_a_multiple_of_the_tile(m, n, k, config):
    gen = generator(k)
    x = randn(m, k, dtype=torch.float16, gen=gen)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(n, generator=gen) * 0.01).to(DEVICE)
    assert_close(w8a16_matmul(x, w, scales, config=config), w8a16_matmul_ref(x, w, scales),
                 torch.float16)


@pytest.mark.parametrize(
    ("m", "n", "k", "group_size"),
    [
        (1, 9, 160, 32),  # K / 8 = 20: no FMA tile divides it, the tensor-core fallback
        (1, 9, 192, 96),  # a group of no power of two at one row: the fallback too
        (3, 17, 160, 40),  # a tile of 16 words straddles groups of 40
        (17, 9, 1024, 128),  # one row past a 16-row tile
    ],
    ids=str,
)
def test_w4a16_k_not_a_multiple_of_the_group_tile(m, n, k, group_size):
    gen = generator(k + m)
    qweight, scales, zeros = quantize_int4(randn(n, k, dtype=torch.float32, gen=gen),
                                           group_size)
    x = randn(m, k, dtype=torch.float32, gen=gen)
    assert_close(w4a16_matmul(x, qweight, scales, zeros, group_size),
                 w4a16_matmul_ref(x, qweight, scales, zeros, group_size), torch.float32,
                 scale=10.0)


def test_decode_refuses_lengths_or_tables_it_would_misread():
    """Fewer lengths or table rows than sequences were read out of bounds, and float lengths
    as integer bits: garbage, without an error."""
    gen = generator(3)
    kc, vc, tables, _ = _cache(4, 2, 64, 16, [5, 16, 1], torch.float32, False, gen)
    query = randn(3, 4, 64, dtype=torch.float32, gen=gen)
    lens = torch.tensor([5, 16, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(query, kc, vc, tables, lens[:2], 0.125)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(query, kc, vc, tables, lens.float(), 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(query, kc, vc, tables[:2], lens, 0.125)


def test_prefill_refuses_float_positions():
    gen = generator(4)
    kc, vc, tables, _ = _cache(4, 2, 64, 16, [5], torch.float32, False, gen)
    query = randn(5, 4, 64, dtype=torch.float32, gen=gen)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention(query, kc, vc, tables, qsl, seq_lens.float(), 0.125)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention(query, kc, vc, tables, qsl.float(), seq_lens, 0.125)


def test_fused_moe_refuses_weights_in_another_dtype():
    """tl.dot needs one dtype: a mismatch was an assertion deep inside Triton."""
    x = torch.zeros(3, 32, dtype=torch.float16, device=DEVICE)
    w13, w2 = torch.zeros(4, 64, 32, device=DEVICE), torch.zeros(4, 32, 32, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13, w2, ids.float(), ids)
