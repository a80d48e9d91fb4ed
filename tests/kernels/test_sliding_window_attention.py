"""Sliding-window attention in every kernel against its reference: the fused C++ decode and
varlen kernels (argosy_kernels.cpu_ops) and the Triton decode and prefill kernels (on the CPU
under TRITON_INTERPRET=1, see conftest.py; on a GPU when there is one).

A query at position p with window W sees the keys p - W < k <= p (transformers' sliding mask).
Windows are chosen to end inside a block, on a block boundary, and to cover the whole context
(the same result as no window). Fresh random inputs each run; the seed is in the failures."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from argosy_kernels import cpu_ops
from argosy_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from argosy_kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kernel_test_utils import DEVICE, assert_close, random_block_tables

SEED = int(torch.randint(0, 2**31 - 1, ()).item())
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_cpu_ops = pytest.mark.skipif(not HAS_COMPILER or not cpu_ops.available(),
                                   reason="no C++ compiler: the kernels are off")


def _gen(offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


class Paged:
    """Random paged K/V caches (of `dtype`, or int8 with float16 scales) holding sequences of
    `lens` tokens in shuffled blocks."""

    def __init__(self, lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, int8: bool, offset: int,
                 device: torch.device | None = None) -> None:
        device = device or torch.device("cpu")
        g = _gen(offset)
        self.g, self.dtype, self.device = g, dtype, device
        num_blocks = sum(-(-n // block_size) for n in lens) + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.scales: dict[str, torch.Tensor] = {}
        if int8:
            self.key, self.value = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
                                    for _ in range(2))
            self.scales = {name: (torch.rand(shape[:-1], generator=g) / 40).half().to(device)
                           for name in ("k_scale", "v_scale")}
        else:
            self.key, self.value = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        self.key, self.value = self.key.to(device), self.value.to(device)
        self.tables = random_block_tables(lens, block_size, num_blocks, g).to(device)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5

    def queries(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.num_heads, self.head_dim, generator=self.g).to(
            self.dtype).to(self.device)


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# (num_heads, num_kv_heads, head_dim, block_size, context lengths, window): the window ends
# inside a block (7, 13), on a block boundary (16, 32), is one key (1), covers the whole
# context (>= every length: the same as no window), and a long context with a short window
# (the C++ kernel's context splits then divide the window).
DECODE_CASES = [
    (9, 3, 64, 16, [1, 16, 37, 200], 13),
    (8, 8, 128, 32, [64, 5, 33], 32),
    (8, 1, 96, 16, [100, 1, 17], 7),
    (4, 2, 64, 16, [30, 9], 1),
    (9, 3, 64, 16, [1001], 300),
    (8, 1, 128, 32, [777, 3], 16),
    (4, 4, 64, 16, [40, 12], 64),
]


def test_the_window_changes_the_reference() -> None:
    """The references honour the window (else the comparisons below prove nothing)."""
    p = Paged([50], 4, 2, 64, 16, torch.float32, False, 0)
    q = p.queries(1)
    lens = _i32([50], p.device)
    full = paged_decode_attention_ref(q, p.key, p.value, p.tables, lens, p.scale)
    windowed = paged_decode_attention_ref(q, p.key, p.value, p.tables, lens, p.scale,
                                          sliding_window=10)
    assert not torch.allclose(full, windowed, atol=1e-3)
    # The window's keys alone, gathered by hand: the same thing.
    blocks = p.tables[0, :4].long()
    keys = p.key[blocks].flatten(0, 1)[40:50]
    values = p.value[blocks].flatten(0, 1)[40:50]
    expected = torch.stack([
        torch.softmax(keys[:, h // 2] @ q[0, h] * p.scale, dim=0) @ values[:, h // 2]
        for h in range(4)])
    torch.testing.assert_close(windowed[0], expected, atol=1e-5, rtol=1e-5)
    prefill = paged_prefill_attention_ref(q, p.key, p.value, p.tables, _i32([0, 1], p.device),
                                          lens, p.scale, sliding_window=10)
    torch.testing.assert_close(prefill, windowed, atol=1e-5, rtol=1e-5)


# ---- C++ (cpu_ops) ------------------------------------------------------------------------------

@needs_cpu_ops
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_cpu_decode_attention_window(case, dtype: torch.dtype, int8: bool) -> None:
    num_heads, num_kv_heads, head_dim, block_size, lens, window = case
    p = Paged(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, int8, 1)
    q, ctx = p.queries(len(lens)), _i32(lens, p.device)
    out = cpu_ops.decode_attention(q, p.key, p.value, p.tables, ctx, p.scale,
                                   sliding_window=window, **p.scales)
    ref = paged_decode_attention_ref(q, p.key, p.value, p.tables, ctx, p.scale,
                                     sliding_window=window, **p.scales)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol,
                               msg=lambda m: f"seed {SEED}: {m}")
    if window >= max(lens):  # no key hidden: the full attention, the same bits
        full = cpu_ops.decode_attention(q, p.key, p.value, p.tables, ctx, p.scale, **p.scales)
        assert torch.equal(out, full)


# (num_heads, num_kv_heads, head_dim, block_size), then per sequence (q_len, seq_len): decode
# rows, a first chunk longer than the window, a chunk after a cached prefix, a chunk ending on a
# block boundary.
VARLEN_SHAPES = [(9, 3, 64, 16), (8, 2, 128, 32), (16, 1, 64, 16)]
VARLEN_SEQS = [(1, 1), (1, 150), (90, 90), (17, 130), (5, 64), (40, 200)]


@needs_cpu_ops
@pytest.mark.skipif(HAS_COMPILER and not cpu_ops.has_avx512_bf16(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [1, 20, 32, 45, 500])
@pytest.mark.parametrize("shape", VARLEN_SHAPES)
def test_cpu_varlen_attention_window(shape, window: int, int8: bool) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    q_lens, seq_lens = [q for q, _ in VARLEN_SEQS], [n for _, n in VARLEN_SEQS]
    p = Paged(seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, int8, 2)
    query = p.queries(sum(q_lens))
    starts = _i32([0, *torch.tensor(q_lens).cumsum(0).tolist()], p.device)
    lens = _i32(seq_lens, p.device)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    cpu_ops.varlen_attention(query, p.key, p.value, p.tables, starts, lens, p.scale,
                             out=out, sliding_window=window, **p.scales)
    ref = paged_prefill_attention_ref(query, p.key, p.value, p.tables, starts, lens, p.scale,
                                      sliding_window=window, **p.scales)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2,
                               msg=lambda m: f"seed {SEED}: {m}")
    if window >= max(seq_lens):
        full = cpu_ops.varlen_attention(query, p.key, p.value, p.tables, starts, lens, p.scale,
                                        **p.scales)
        assert torch.equal(out, full)


@needs_cpu_ops
@pytest.mark.skipif(HAS_COMPILER and not cpu_ops.has_avx512_bf16(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("int8", [False, True])
def test_cpu_varlen_window_each_query_is_the_same_bits_however_it_is_batched(int8: bool) -> None:
    """With a window a task starts at its first row's window, so a query's tiles depend on its
    chunk: the tiles before its own window must leave it exactly as it was (the
    batch-invariant mode's guarantee)."""
    n, window = 150, 37
    p = Paged([n, 70], 9, 3, 64, 16, torch.bfloat16, int8, 3)
    query = p.queries(n)

    def run(rows: torch.Tensor, q_lens: list[int], seq_lens: list[int], seqs: list[int]) -> torch.Tensor:
        starts = _i32([0, *torch.tensor(q_lens).cumsum(0).tolist()], p.device)
        return cpu_ops.varlen_attention(rows, p.key, p.value, p.tables[seqs].contiguous(), starts,
                                        _i32(seq_lens, p.device), p.scale, sliding_window=window,
                                        **p.scales)

    whole = run(query, [n], [n], [0])
    g = _gen(4)
    for attempt in range(3):
        cuts = sorted(set(torch.randint(1, n, (5,), generator=g).tolist()))
        bounds = [0, *cuts, n] if attempt < 2 else list(range(0, n + 1, 1))
        for a, b in zip(bounds, bounds[1:]):
            rows = torch.cat([p.queries(1), query[a:b]])
            out = run(rows, [1, b - a], [60, b], [1, 0])
            assert torch.equal(out[1:], whole[a:b]), (attempt, a, b)


# ---- Triton (interpreter on the CPU) --------------------------------------------------------------

@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [DECODE_CASES[0], DECODE_CASES[3], DECODE_CASES[6],
                                  (4, 2, 64, 8, [64, 50, 3], 40)])
def test_triton_decode_attention_window(case, dtype: torch.dtype, int8: bool) -> None:
    num_heads, num_kv_heads, head_dim, block_size, lens, window = case
    lens = [min(n, 64) for n in lens]  # the interpreter is slow
    p = Paged(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, int8, 5, DEVICE)
    q, ctx = p.queries(len(lens)), _i32(lens, DEVICE)
    ref = paged_decode_attention_ref(q, p.key, p.value, p.tables, ctx, p.scale,
                                     sliding_window=window, **p.scales)
    for splits in (1, 3):  # one pass, and the window cut into splits combined afterwards
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, p.key, p.value, p.tables, ctx, p.scale, out=out,
                               num_splits=splits, sliding_window=window, **p.scales)
        assert_close(out, ref, dtype, scale=2.0 if int8 else 1.0)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 12, 16, 100])
def test_triton_prefill_attention_window(dtype: torch.dtype, window: int, int8: bool) -> None:
    # A first chunk longer than the window (rows of one query tile whose windows start past
    # the tile's first keys), a chunk after a cached prefix, a decode row, a block boundary.
    q_lens, seq_lens = [40, 9, 1, 16], [40, 45, 30, 32]
    p = Paged(seq_lens, 4, 2, 32, 8, dtype, int8, 6, DEVICE)
    query = p.queries(sum(q_lens))
    starts = _i32([0, *torch.tensor(q_lens).cumsum(0).tolist()], DEVICE)
    lens = _i32(seq_lens, DEVICE)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, p.key, p.value, p.tables, starts, lens, p.scale, out=out,
                            max_query_len=max(q_lens), sliding_window=window, **p.scales)
    ref = paged_prefill_attention_ref(query, p.key, p.value, p.tables, starts, lens, p.scale,
                                      sliding_window=window, **p.scales)
    assert_close(out, ref, dtype, scale=2.0 if int8 else 1.0)


def test_triton_rejects_a_bad_window() -> None:
    p = Paged([8], 4, 2, 32, 8, torch.float32, False, 7, DEVICE)
    q = p.queries(1)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, p.key, p.value, p.tables, _i32([8], DEVICE), p.scale,
                               sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_prefill_attention(q, p.key, p.value, p.tables, _i32([0, 1], DEVICE),
                                _i32([8], DEVICE), p.scale, sliding_window=-3)
