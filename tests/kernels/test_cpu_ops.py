"""The fused C++ CPU kernels (argosy_kernels.cpu_ops) against their PyTorch references, on
fresh random inputs each run (the seed is in every failure message)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops
from argosy_kernels.paged_attention import paged_decode_attention_ref
from argosy_kernels.reshape_and_cache import reshape_and_cache_ref
from argosy_runtime.models.llama import RMSNorm
from argosy_runtime.models.rotary import RotaryEmbedding
from kernel_test_utils import random_block_tables

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the kernels are off")

DTYPES = [torch.float32, torch.bfloat16]
SEED = int(torch.randint(0, 2**31 - 1, ()).item())


def _gen(offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0
           ) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # bfloat16: the kernels round where eager ops round, so results differ by at most one ulp
    # (2^-7 relative at the bottom of a binade), where a float32 sum ordered differently or
    # a vector expf lands across a rounding boundary.
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol,
                               msg=lambda m: f"seed {SEED}: {m}")


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    # Loads the ops for every test here (each also runs alone, with -k), and a broken build
    # fails them all rather than silently leaving the slower PyTorch path.
    assert cpu_ops.available(), "cpu_ops did not build; see the argosy.kernels warning"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norm_matches_the_model_norm(dtype: torch.dtype, rows: int) -> None:
    g = _gen(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = _randn(576, dtype=dtype, gen=g)
    x = _randn(rows, 576, dtype=dtype, gen=g, scale=3.0)
    _assert_close(cpu_ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype: torch.dtype) -> None:
    g = _gen(1)
    norm = RMSNorm(320, 1e-6).to(dtype)
    norm.weight.data = _randn(320, dtype=dtype, gen=g)
    residual = _randn(9, 320, dtype=dtype, gen=g)
    x = _randn(9, 320, dtype=dtype, gen=g)
    expected_residual = residual + x
    out = cpu_ops.add_rms_norm(residual, x, norm.weight, norm.eps)
    assert torch.equal(residual, expected_residual)  # one rounding, exactly as eager
    _assert_close(out, norm(expected_residual), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_row_strided_input(dtype: torch.dtype) -> None:
    g = _gen(2)
    wide = _randn(5, 300, dtype=dtype, gen=g)
    x = wide[:, :256]  # rows 300 apart
    w = _randn(256, dtype=dtype, gen=g)
    norm = RMSNorm(256, 1e-5).to(dtype)
    norm.weight.data = w
    _assert_close(cpu_ops.rms_norm(x, w, 1e-5), norm(x.contiguous()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    padded = _randn(rows, 2 * 1536 + 16, dtype=dtype, gen=_gen(rows), scale=4.0)
    gate_up = padded[:, : 2 * 1536]  # rows may be strided (an int4 layer's padded output)
    gate, up = gate_up.split(1536, dim=-1)
    _assert_close(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_inside_the_fused_qkv_rows(dtype: torch.dtype, head_dim: int) -> None:
    g = _gen(head_dim)
    num_q, num_kv, tokens = 6, 2, 11
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = _randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype, gen=g)
    qk = qkv[:, : (num_q + num_kv) * head_dim].view(tokens, num_q + num_kv, head_dim)
    v_before = qkv[:, (num_q + num_kv) * head_dim :].clone()
    tables = rotary.tables(positions)
    expected = rotary.rotate(qk.clone(), tables)
    cpu_ops.rotary_embedding(qk, *tables)
    _assert_close(qk, expected, dtype)
    assert torch.equal(qkv[:, (num_q + num_kv) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_turns_the_first_rotary_dim_values(dtype: torch.dtype) -> None:
    """Phi-4-mini's partial rotary: tables rotary_dim (48) wide, pairs (i, i + 24), the last
    16 values of each 64-wide head untouched, as RotaryEmbedding.rotate does."""
    g = _gen(48)
    tokens, heads, head_dim = 9, 5, 64
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype, rotary_dim=48)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    qkv = _randn(tokens, (heads + 1) * head_dim, dtype=dtype, gen=g)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    before = qk.clone()
    tables = rotary.tables(positions)
    assert tables[0].shape == (tokens, 1, 48)
    expected = rotary.rotate(qk.clone(), tables)
    cpu_ops.rotary_embedding(qk, *tables)
    _assert_close(qk, expected, dtype)
    assert torch.equal(qk[..., 48:], before[..., 48:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    g = _gen(3)
    key_cache = torch.zeros(6, 16, 3, 64, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    kv = _randn(5, 2 * 3 * 64, dtype=dtype, gen=g)  # strided views, as inside qkv
    key, value = (t.view(5, 3, 64) for t in kv.split(3 * 64, dim=-1))
    slots = torch.tensor([17, 3, -1, 95, 40])
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([0, 1, 2, 3, 96]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_int8_equals_reference_bit_for_bit(dtype: torch.dtype) -> None:
    g = _gen(4)
    key_cache = torch.zeros(6, 16, 3, 64, dtype=torch.int8)
    value_cache = torch.zeros_like(key_cache)
    k_scale = torch.zeros(6, 16, 3, dtype=torch.float16)
    v_scale = torch.zeros_like(k_scale)
    kv = _randn(7, 2 * 3 * 64, dtype=dtype, gen=g, scale=5.0)
    kv[1] = 0  # an all-zero head stores a zero scale and zeros
    kv[2, :64] *= 1e-6  # an underflowing scale
    key, value = (t.view(7, 3, 64) for t in kv.split(3 * 64, dim=-1))
    slots = torch.tensor([17, 3, 5, -1, 95, 40, 0])
    ref = [t.clone() for t in (key_cache, value_cache, k_scale, v_scale)]
    reshape_and_cache_ref(key, value, ref[0], ref[1], slots, k_scale=ref[2], v_scale=ref[3])
    cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale=k_scale,
                              v_scale=v_scale)
    for got, want in zip((key_cache, value_cache, k_scale, v_scale), ref, strict=True):
        assert torch.equal(got, want), f"seed {SEED}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(960, 576), (13, 100), (72, 1536)])  # row and k tails too
def test_int8_gemv_matches_the_dequantized_product(dtype: torch.dtype, n: int, k: int) -> None:
    g = _gen(n + k)
    qweight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 50).to(dtype)
    x = _randn(1, k, dtype=dtype, gen=g)
    expected = (x.double() @ qweight.double().t()) * scales.double()  # the exact product
    out = cpu_ops.int8_gemv(x, qweight, scales)
    if dtype == torch.float32:
        # A float32 sum of k products, against the exact one: the rounding error grows with k
        # (about sqrt(k) ulps of the sum of |terms| in practice); a fixed 1e-5 failed at k=1536.
        terms = (x.double().abs() @ qweight.double().abs().t()) * scales.double()
        bound = 4 * k**0.5 * 2**-24 * terms
        assert ((out.double() - expected).abs() <= bound).all(), f"seed {SEED}"
    else:
        _assert_close(out, expected, dtype)
    with pytest.raises(RuntimeError, match="1, in_features"):
        cpu_ops.int8_gemv(torch.cat([x, x]), qweight, scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(17, 960, 576), (32, 1000, 1536), (2, 13, 100), (33, 1003, 576),
                                   (20, 24, 101)])  # several slices; row, token and odd-k tails
def test_int8_matmul_matches_the_dequantized_product(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    g = _gen(m + n + k)
    qweight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 50).to(dtype)
    x = _randn(m, k, dtype=dtype, gen=g)
    out = cpu_ops.int8_matmul(x, qweight, scales)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    expected = (x.double() @ qweight.double().t()) * scales.double()
    if dtype == torch.float32:  # BLAS sums in float32, in its own order
        terms = (x.double().abs() @ qweight.double().abs().t()) * scales.double()
        assert ((out.double() - expected).abs() <= 4 * k**0.5 * 2**-24 * terms + 1e-6).all(), f"seed {SEED}"
    else:  # the products are exact; float32 sums, rounded to bfloat16 (once or twice)
        _assert_close(out, expected, dtype)
    with pytest.raises(RuntimeError, match="scales must be"):
        cpu_ops.int8_matmul(x, qweight, scales[:-1])


@pytest.mark.skipif(not cpu_ops.has_avx512_bf16(), reason="the bf16 int8 kernel needs AVX512-BF16")
@pytest.mark.parametrize("n,k", [(1040, 4096), (200, 578)])  # 65 and 13 row blocks; 289 pairs
def test_int8_matmul_gives_each_row_the_same_bits_for_any_row_count(n: int, k: int) -> None:
    """bfloat16 (the batch-invariant mode's int8 kernel): up to 4 tokens take the rows-in-lanes
    loop (gathered weight rows), more the token-lane kernel; a row's result is the same bits
    either way. 4096 inputs: another summation order would cross a bf16 rounding boundary."""
    g = _gen(n + k)
    qweight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 50).bfloat16()
    x = _randn(40, k, dtype=torch.bfloat16, gen=g)
    every = cpu_ops.int8_matmul(x, qweight, scales)
    _assert_close(every, (x.double() @ qweight.double().t()) * scales.double(), torch.bfloat16)
    alone = torch.cat([cpu_ops.int8_matmul(x[i : i + 1], qweight, scales) for i in range(40)])
    assert torch.equal(alone, every)  # all 40 x n values: a reordered sum flips a few
    for start, rows in [(5, 2), (9, 3), (20, 4), (30, 5), (3, 17)]:
        assert torch.equal(cpu_ops.int8_matmul(x[start : start + rows], qweight, scales),
                           every[start : start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 3, 5, 8, 9, 13, 16])  # passes of up to 8 tokens
@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (1, 24)])  # row and k tails, a lone row
def test_int8_linear_few_rows_match_the_dequantized_product(dtype: torch.dtype, m: int, n: int,
                                                             k: int) -> None:
    """2-16 token rows: argosy's few-row kernel (bfloat16) or PyTorch's packed one (float32)."""
    g = _gen(m + n + k)
    qweight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 50).to(dtype)
    x = _randn(m, k, dtype=dtype, gen=g)
    out = cpu_ops.int8_linear(x, qweight, scales, 16)
    assert out.shape == (m, n) and out.dtype == dtype
    expected = (x.double() @ qweight.double().t()) * scales.double()
    if dtype == torch.float32:
        terms = (x.double().abs() @ qweight.double().abs().t()) * scales.double()
        assert ((out.double() - expected).abs() <= 4 * k**0.5 * 2**-24 * terms + 1e-6).all(), f"seed {SEED}"
    else:
        _assert_close(out, expected, dtype)
        with pytest.raises(RuntimeError, match="scales must be"):
            cpu_ops.int8_linear(x, qweight, scales[:-1], 16)


def _int4_weight(n: int, kp: int, group: int, dtype: torch.dtype, g: torch.Generator):
    q = torch.randint(0, 16, (n, kp), generator=g, dtype=torch.uint8)
    scales = torch.rand(kp // group, n, generator=g) / 50 + 1e-3
    zeros = torch.randn(kp // group, n, generator=g) / 50
    sz = torch.stack([scales, zeros], dim=-1).to(dtype)
    s, z = (sz[..., i].double().t().repeat_interleave(group, dim=1) for i in (0, 1))
    return q, sz, (q.double() - 8) * s + z  # Int4Linear's w = (q - 8) * scale + zero


def test_int4_pack_round_trip() -> None:
    q = torch.randint(0, 16, (48, 96), generator=_gen(), dtype=torch.uint8)
    packed = cpu_ops.pack_int4(q)
    assert packed.shape == (48, 48) and packed.dtype == torch.uint8
    assert torch.equal(cpu_ops.unpack_int4(packed), q)
    # the documented layout: row 1, input 2 (f = 1, j = 0) is the high nibble of the low byte
    # of word 2 * 1 + 0 in the first 64-byte block of the first tile
    assert packed.flatten()[(2 * 1 + 0) * 2] >> 4 == q[1, 2]
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_ops.pack_int4(q[:40])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 33, 50])  # one unpack serves up to 4 rows: tails too; many rows
def test_int4_matmul_matches_the_dequantized_product(dtype: torch.dtype, group: int, m: int) -> None:
    g = _gen(group + m)
    n, kp = 208, 2 * 384 if group == 128 else 576  # 13 tiles of 16 rows: uneven thread split
    q, sz, w = _int4_weight(n, kp, group, dtype, g)
    x = _randn(m, kp, dtype=dtype, gen=g)
    out = cpu_ops.int4_matmul(x, cpu_ops.pack_int4(q), sz, group)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.bfloat16 and m >= 16:  # the many-row path rounds w to bfloat16 first
        w = w.to(dtype).double()
    expected = x.double() @ w.t()
    if dtype == torch.float32:  # a float32 sum of kp terms, against the exact one
        bound = 4 * kp**0.5 * 2**-24 * (x.double().abs() @ w.abs().t()) + 1e-6
        assert ((out.double() - expected).abs() <= bound).all(), f"seed {SEED}"
    else:
        _assert_close(out, expected, dtype)


@pytest.mark.skipif(not cpu_ops.has_avx512_bf16(), reason="the many-row path needs AVX512-BF16")
@pytest.mark.parametrize("group", [32, 128])
def test_int4_many_row_path_gives_each_row_the_same_bits_for_any_row_count(group: int) -> None:
    """many_rows_from=1 (the batch-invariant mode): up to 4 rows take the rows-in-lanes loop,
    more the token-lane kernel; a row's result is the same bits either way, and matches the
    product with w rounded to bfloat16. 65 tiles: the side-by-side groups of 4 end uneven;
    4096 inputs: another summation order would cross some bfloat16 rounding boundary."""
    g = _gen(group + 99)
    n, kp = 1040, 4096
    q, sz, w = _int4_weight(n, kp, group, torch.bfloat16, g)
    packed = cpu_ops.pack_int4(q)
    x = _randn(40, kp, dtype=torch.bfloat16, gen=g)
    every = torch.ops.argosy_cpu.int4_matmul(x, packed, sz, group, 1)
    _assert_close(every, x.double() @ w.to(torch.bfloat16).double().t(), torch.bfloat16)
    for start, rows in [(0, 1), (5, 2), (9, 3), (20, 4), (30, 5), (3, 17)]:
        part = torch.ops.argosy_cpu.int4_matmul(x[start : start + rows], packed, sz, group, 1)
        assert torch.equal(part, every[start : start + rows]), (start, rows)


def test_int4_matmul_rejects_bad_inputs() -> None:
    q, sz, _ = _int4_weight(32, 128, 32, torch.bfloat16, _gen())
    packed = cpu_ops.pack_int4(q)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales_and_zeros must be"):
        cpu_ops.int4_matmul(x, packed, sz, 64)  # group size of another layout
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \[M, 128\]"):
        cpu_ops.int4_matmul(torch.randn(1, 64, dtype=torch.bfloat16), packed, sz, 32)
    with pytest.raises(RuntimeError, match="x's dtype"):
        cpu_ops.int4_matmul(x.float(), packed, sz, 32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ops.int4_matmul(x, packed[:8], sz[:, :8], 32)


# (num_heads, num_kv_heads, head_dim, block_size, context_lens): GQA 1/3/8, head dims 64/128
# and one without a compile-time specialization (96), context 1, block-boundary and partial.
# The last two have fewer (sequence, kv head) pairs than 4 per thread and long contexts, so
# the kernel splits each context and merges the parts (uneven tails; the 3-token context
# leaves three of its splits empty).
ATTENTION_CASES = [
    (9, 3, 64, 16, [1, 16, 37, 200]),
    (8, 8, 128, 32, [64, 5, 33]),
    (8, 1, 96, 16, [100, 1, 17]),
    (9, 3, 64, 16, [1001]),
    (8, 1, 128, 32, [777, 3]),
]


def _attention_inputs(case, dtype, offset):
    num_heads, num_kv_heads, head_dim, block_size, lens = case
    g = _gen(offset)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=g)
    value_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=g)
    # The query as the model hands it over: q heads inside wider qkv rows.
    qkv = _randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=g)
    query = qkv[:, : num_heads * head_dim].view(len(lens), num_heads, head_dim)
    tables = random_block_tables(lens, block_size, num_blocks, g)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_matches_reference(dtype: torch.dtype, case) -> None:
    query, key_cache, value_cache, tables, lens = _attention_inputs(case, dtype, 10)
    scale = case[2] ** -0.5
    out = cpu_ops.decode_attention(query, key_cache, value_cache, tables, lens, scale)
    ref = paged_decode_attention_ref(query, key_cache, value_cache, tables, lens, scale)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [ATTENTION_CASES[0], ATTENTION_CASES[3]], ids=["batch", "split"])
def test_decode_attention_int8_cache(dtype: torch.dtype, case) -> None:
    query, key_cache, value_cache, tables, lens = _attention_inputs(case, dtype, 11)
    g = _gen(12)
    k8 = torch.randint(-127, 128, key_cache.shape, generator=g, dtype=torch.int8)
    v8 = torch.randint(-127, 128, value_cache.shape, generator=g, dtype=torch.int8)
    k_scale = (torch.rand(key_cache.shape[:-1], generator=g) / 100).half()
    v_scale = (torch.rand(value_cache.shape[:-1], generator=g) / 100).half()
    out = cpu_ops.decode_attention(query, k8, v8, tables, lens, 0.125, k_scale=k_scale,
                                   v_scale=v_scale)
    ref = paged_decode_attention_ref(query, k8, v8, tables, lens, 0.125, k_scale=k_scale,
                                     v_scale=v_scale)
    _assert_close(out, ref, dtype)


def test_decode_attention_rejects_bad_inputs() -> None:
    query, key_cache, value_cache, tables, lens = _attention_inputs(ATTENTION_CASES[0],
                                                                    torch.float32, 13)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_ops.decode_attention(query, key_cache, value_cache, tables,
                                 torch.tensor([1, 1, 1, 10_000], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.decode_attention(query, key_cache, value_cache, tables.long(), lens, 0.1)
    with pytest.raises(RuntimeError, match="needs k_scale"):
        cpu_ops.decode_attention(query, key_cache.to(torch.int8), value_cache.to(torch.int8),
                                 tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.rms_norm(torch.ones(2, 4, dtype=torch.float16), torch.ones(4, dtype=torch.float16), 1e-5)


# (num_heads, num_kv_heads, head_dim, block_size, q_len, seq_len): GQA 1/3/8, head dims 64
# and 128, block sizes 16/32; fresh prompts and chunks after 1, 31, 32 (a key-tile boundary)
# and 150 cached tokens; chunks of 1, 15, 16, 17 (query-block edges) and 50 tokens.
PREFILL_CASES = [
    (9, 3, 64, 16, 37, 37),
    (9, 3, 64, 16, 16, 47),
    (9, 3, 64, 16, 50, 200),
    (8, 8, 128, 32, 17, 18),
    (8, 8, 128, 32, 1, 33),
    (4, 1, 64, 32, 15, 47),
    (8, 1, 128, 16, 33, 64),
]
needs_bf16_kernels = pytest.mark.skipif(not cpu_ops.has_avx512_bf16(),
                                        reason="the bf16 prefill kernel needs AVX512-BF16")


def _prefill_inputs(case, offset, int8=False):
    num_heads, num_kv_heads, head_dim, block_size, q_len, seq_len = case
    g = _gen(offset)
    num_blocks = -(-seq_len // block_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    scales = {}
    if int8:
        key_cache, value_cache = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
                                  for _ in range(2))
        scales = {name: (torch.rand(shape[:-1], generator=g) / 50).half()
                  for name in ("k_scale", "v_scale")}
    else:
        key_cache, value_cache = (_randn(*shape, dtype=torch.bfloat16, gen=g) for _ in range(2))
    # The query as the model hands it over: q heads inside wider qkv rows.
    qkv = _randn(q_len, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16, gen=g)
    query = qkv[:, : num_heads * head_dim].view(q_len, num_heads, head_dim)
    table = torch.randperm(num_blocks, generator=g)[: -(-seq_len // block_size)].int()
    return query, key_cache, value_cache, table, scales


def _prefill_reference(query, key_cache, value_cache, table, seq_len, scale, scales):
    from argosy_kernels.paged_prefill_attention import paged_prefill_attention_ref

    starts = torch.tensor([0, query.shape[0]], dtype=torch.int32)
    return paged_prefill_attention_ref(query, key_cache, value_cache, table[None], starts,
                                       torch.tensor([seq_len], dtype=torch.int32), scale,
                                       **scales)


@needs_bf16_kernels
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention_matches_reference(case, int8: bool) -> None:
    query, key_cache, value_cache, table, scales = _prefill_inputs(case, 20, int8)
    seq_len, scale = case[5], case[2] ** -0.5
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)  # unwritten: NaN
    cpu_ops.prefill_attention(query, key_cache, value_cache, table, seq_len, scale, out=out,
                              **scales)
    ref = _prefill_reference(query, key_cache, value_cache, table, seq_len, scale, scales)
    # The probabilities are rounded to bf16 before the product with V, as PyTorch's CPU flash
    # kernel does: a few bf16 ulps of the output.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_bf16_kernels
def test_prefill_attention_is_causal_with_peaked_scores() -> None:
    """Large scores make each query attend almost only to its best key: a key the query
    may not see yet (a later position) would show at once."""
    case = (9, 3, 64, 16, 40, 90)
    query, key_cache, value_cache, table, _ = _prefill_inputs(case, 21)
    out = cpu_ops.prefill_attention(query, key_cache, value_cache, table, 90, 2.0)
    ref = _prefill_reference(query, key_cache, value_cache, table, 90, 2.0, {})
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@needs_bf16_kernels
def test_prefill_attention_rejects_bad_inputs() -> None:
    query, key_cache, value_cache, table, _ = _prefill_inputs(PREFILL_CASES[1], 22)
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        cpu_ops.prefill_attention(query, key_cache, value_cache, table, 10_000, 0.1)
    with pytest.raises(RuntimeError, match="shorter than the chunk"):
        cpu_ops.prefill_attention(query, key_cache, value_cache, table, 3, 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_ops.prefill_attention(query.float(), key_cache, value_cache, table, 47, 0.1)
    with pytest.raises(RuntimeError, match="needs k_scale"):
        cpu_ops.prefill_attention(query, key_cache.to(torch.int8), value_cache.to(torch.int8),
                                  table, 47, 0.1)


def test_switched_off_by_environment() -> None:
    code = "from argosy_kernels import cpu_ops; print(cpu_ops.available())"
    env = {**os.environ, "ARGOSY_CPU_OPS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_stale_build_lock_is_removed(tmp_path) -> None:
    # torch waits for a build lock to disappear, forever; a killed builder must not hang
    # every later start.
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    fresh.touch()
    stale.touch()
    os.utime(stale, (0, 0))
    cpu_ops._remove_stale_lock(fresh)
    cpu_ops._remove_stale_lock(stale)
    cpu_ops._remove_stale_lock(tmp_path / "missing")
    assert fresh.exists() and not stale.exists()


@pytest.mark.parametrize(("tokens", "rows"), [(1, None), (8, None), (8, [1, 4, 6]),
                                              (16, None), (40, None), (40, list(range(0, 40, 2)))])
@pytest.mark.parametrize(("fan_in", "rank", "fan_out"), [(576, 48, 960), (1536, 16, 576)])
def test_lora_add_matches_the_torch_reference(tokens: int, rows: list[int] | None, fan_in: int,
                                              rank: int, fan_out: int) -> None:
    """out[rows] += scale * (x[rows] A^T) B^T: the fused pass (up to 16 rows) and the
    at::linear fallback (more rows) against float64 torch, on fresh random inputs; the other
    rows are left untouched (the output is poisoned with NaN there only when rows are given,
    so a write outside them fails)."""
    assert cpu_ops.available()
    gen = torch.Generator().manual_seed(tokens * 1000 + fan_in + rank)
    x = torch.randn(tokens, fan_in, generator=gen).bfloat16()
    a = (torch.randn(rank, fan_in, generator=gen) * 0.05).bfloat16()
    b = (torch.randn(fan_out, rank, generator=gen) * 0.05).bfloat16()
    out = torch.randn(tokens, fan_out, generator=gen).bfloat16()
    index = torch.tensor(rows if rows is not None else [], dtype=torch.long)
    picked = index if rows is not None else torch.arange(tokens)
    if rows is not None:
        others = [r for r in range(tokens) if r not in rows]
        out[others] = float("nan")
    expected = out.double()
    expected[picked] += 1.5 * (x[picked].double() @ a.double().T) @ b.double().T
    torch.ops.argosy_cpu.lora_add(out, x, index, a, b, 1.5)
    if rows is not None:
        assert torch.isnan(out[others]).all()  # untouched
    got, want = out[picked].double(), expected[picked]
    # bfloat16 storage: one rounding of the result (two for the at::linear fallback).
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (got - want).abs().max()


def test_lora_add_fused_for_any_row_count_gives_each_row_the_same_bits() -> None:
    """fused_max_rows=-1 (the batch-invariant mode): 40 rows take the fused pass, and each
    row's result equals that row computed alone or among 3, bit for bit; the default switches
    to at::linear past 16 rows, which rounds twice more."""
    assert cpu_ops.available()
    gen = torch.Generator().manual_seed(SEED + 7)
    x = torch.randn(40, 576, generator=gen).bfloat16()
    a = (torch.randn(16, 576, generator=gen) * 0.05).bfloat16()
    b = (torch.randn(960, 16, generator=gen) * 0.05).bfloat16()
    base = torch.randn(40, 960, generator=gen).bfloat16()
    every = base.clone()
    torch.ops.argosy_cpu.lora_add(every, x, torch.empty(0, dtype=torch.long), a, b, 0.5, -1)
    for rows in ([7], [0, 20, 39]):
        some = base.clone()
        torch.ops.argosy_cpu.lora_add(some, x, torch.tensor(rows), a, b, 0.5, -1)
        assert torch.equal(some[rows], every[rows])
    default = base.clone()
    torch.ops.argosy_cpu.lora_add(default, x, torch.empty(0, dtype=torch.long), a, b, 0.5)
    assert not torch.equal(default, every)  # the GEMM path: another rounding
