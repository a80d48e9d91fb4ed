"""The launchers accept index and scale tensors that are views with a non-unit stride (block
tables, lengths, slot mappings, positions, per-channel scales): the references take any
layout, so the Triton kernels must give the same result as for contiguous copies, not read
every other element. Fresh random inputs, seeded."""

from __future__ import annotations

import torch
from argosy_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from argosy_kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from argosy_kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from argosy_kernels.rotary_embedding import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)
from argosy_kernels.w8a16_matmul import w8a16_matmul, w8a16_matmul_ref
from kernel_test_utils import DEVICE, assert_close, generator, randn, random_block_tables


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as `t` in a view whose last dimension has stride 2 (every other
    element of a wider tensor holding garbage in between)."""
    wide = torch.stack([t, torch.full_like(t, 7)], dim=-1)  # [..., n, 2]
    view = wide[..., 0]
    assert torch.equal(view, t) and (t.dim() == 0 or view.stride(-1) == 2)
    return view


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` [rows, cols] as the transpose of a contiguous [cols, rows]: stride(1) != 1."""
    view = t.t().contiguous().t()
    assert torch.equal(view, t) and view.stride(1) != 1
    return view


def _paged(lens: list[int], g: torch.Generator):
    block_size, num_kv_heads, head_dim = 16, 2, 64
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    kc = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, gen=g)
    vc = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, gen=g)
    tables = random_block_tables(lens, block_size, num_blocks, g)
    return kc, vc, tables, head_dim**-0.5


def test_decode_attention_strided_tables_and_lengths():
    g = generator(21)
    lens = [5, 20, 33]
    kc, vc, tables, scale = _paged(lens, g)
    query = randn(len(lens), 4, 64, dtype=torch.float32, gen=g)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    want = paged_decode_attention_ref(query, kc, vc, tables, context_lens, scale)
    got = paged_decode_attention(query, kc, vc, _column_major(tables), _strided(context_lens),
                                 scale, num_splits=2)
    assert_close(got, want, torch.float32)


def test_prefill_attention_strided_tables_and_lengths():
    g = generator(22)
    seqs = [(5, 5), (20, 20), (9, 33)]  # (query_len, seq_len)
    kc, vc, tables, scale = _paged([n for _, n in seqs], g)
    qsl = torch.tensor([0, 5, 25, 34], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device=DEVICE)
    query = randn(34, 4, 64, dtype=torch.float32, gen=g)
    want = paged_prefill_attention_ref(query, kc, vc, tables, qsl, seq_lens, scale)
    got = paged_prefill_attention(query, kc, vc, _column_major(tables), _strided(qsl),
                                  _strided(seq_lens), scale, max_query_len=20)
    assert_close(got, want, torch.float32)


def test_reshape_and_cache_strided_slot_mapping():
    g = generator(23)
    key = randn(5, 2, 64, dtype=torch.float32, gen=g)
    value = randn(5, 2, 64, dtype=torch.float32, gen=g)
    slots = torch.tensor([3, 40, -1, 17, 0], dtype=torch.int64, device=DEVICE)
    caches = [torch.zeros(4, 16, 2, 64, device=DEVICE) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], _strided(slots))
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rotary_embedding_strided_positions():
    g = generator(24)
    cache = build_cos_sin_cache(64, 32, device=DEVICE)
    positions = torch.randint(1, 32, (5,), generator=g).to(DEVICE)
    q = randn(5, 3, 64, dtype=torch.float32, gen=g)
    q_ref = q.clone()
    rotary_embedding(_strided(positions), q, None, cache)
    rotary_embedding_ref(positions, q_ref, None, cache)
    assert_close(q, q_ref, torch.float32)


def test_w8a16_strided_scales():
    g = generator(25)
    w = torch.randint(-127, 128, (24, 40), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(24, generator=g) * 0.02 + 0.001).to(DEVICE)
    for m in (1, 3):  # the one-row FMA kernel and the tensor-core kernel
        x = randn(m, 40, dtype=torch.float32, gen=g)
        assert_close(w8a16_matmul(x, w, _strided(scales)), w8a16_matmul_ref(x, w, scales),
                     torch.float32, scale=4.0)
