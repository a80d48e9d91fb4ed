"""cpu_ops.varlen_attention: the chunks of several sequences in one call, against the torch
reference, and bit for bit the same per query whatever the chunking, the other sequences in the
call and the thread count (what the engine's batch-invariant mode rests on)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from argosy_kernels import cpu_ops
from argosy_kernels.paged_prefill_attention import paged_prefill_attention_ref

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                       reason="no C++ compiler: the kernels are off"),
    pytest.mark.skipif(not cpu_ops.has_avx512_bf16(), reason="the kernel needs AVX512-BF16"),
]

SEED = int(torch.randint(0, 2**31 - 1, ()).item())


class Caches:
    """Random paged K/V caches (bf16, or int8 with float16 scales) and a random block table
    per sequence, all in one pool of blocks."""

    def __init__(self, seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, int8: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(SEED + seed)
        self.g = g
        widths = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(widths) + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.scales = {}
        if int8:
            self.key, self.value = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
                                    for _ in range(2))
            self.scales = {name: (torch.rand(shape[:-1], generator=g) / 50).half()
                           for name in ("k_scale", "v_scale")}
        else:
            self.key, self.value = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
        blocks = torch.randperm(num_blocks, generator=g).int()
        self.tables = torch.zeros(len(seq_lens), max(widths) + 1, dtype=torch.int32)
        used = 0
        for s, w in enumerate(widths):
            self.tables[s, :w] = blocks[used : used + w]
            used += w
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5

    def queries(self, rows: int) -> torch.Tensor:
        # Strided rows, as the model hands them over: q heads inside wider qkv rows.
        width = (self.num_heads + 2) * self.head_dim
        qkv = torch.randn(rows, width, generator=self.g).bfloat16()
        return qkv[:, : self.num_heads * self.head_dim].view(rows, self.num_heads, self.head_dim)

    def run(self, query, seqs: list[int], q_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        """varlen_attention of `query` (the chunks back to back) for sequences `seqs`."""
        out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)  # unwritten: NaN
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return cpu_ops.varlen_attention(query, self.key, self.value, self.tables[seqs].contiguous(),
                                        starts, torch.tensor(seq_lens, dtype=torch.int32),
                                        self.scale, out=out, **self.scales)

    def reference(self, query, seqs, q_lens, seq_lens) -> torch.Tensor:
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return paged_prefill_attention_ref(query, self.key, self.value, self.tables[seqs],
                                           starts, torch.tensor(seq_lens, dtype=torch.int32),
                                           self.scale, **self.scales)


# (num_heads, num_kv_heads, head_dim, block_size): GQA groups 3, 1, 4, 8, 16
SHAPES = [(9, 3, 64, 16), (4, 4, 64, 32), (8, 2, 128, 16), (8, 1, 128, 32), (16, 1, 64, 16)]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_for_mixed_chunks(shape, int8: bool) -> None:
    """Decode rows (one query), short and long chunks, a first chunk and one after a cached
    prefix, a sequence ending exactly on a block boundary: one call."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    seq_lens = [1, 37, 2 * block_size, 90, 50]
    q_lens = [1, 1, 5, 90, 17]
    caches = Caches(seq_lens, num_heads, num_kv_heads, head_dim, block_size, int8, seed=1)
    query = caches.queries(sum(q_lens))
    seqs = list(range(len(seq_lens)))
    out = caches.run(query, seqs, q_lens, seq_lens)
    ref = caches.reference(query, seqs, q_lens, seq_lens)
    assert not out.isnan().any()
    # The probabilities are rounded to bf16 before the product with V, as PyTorch's CPU flash
    # kernel does: a few bf16 ulps of the output.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]])
def test_each_query_is_the_same_bits_however_it_is_batched(shape, int8: bool) -> None:
    """A 150-token sequence computed as one chunk, as random chunks each beside other
    sequences, as decode rows one at a time, on 1 or 2 threads: every query's output equal
    bit for bit."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    n = 150
    seq_lens = [n, 70, 300]  # the target, then two others that share the calls
    caches = Caches(seq_lens, num_heads, num_kv_heads, head_dim, block_size, int8, seed=2)
    query = caches.queries(n)
    whole = caches.run(query, [0], [n], [n])
    g = torch.Generator().manual_seed(SEED + 3)
    threads = torch.get_num_threads()
    try:
        for attempt in range(4):
            torch.set_num_threads(1 + attempt % 2)
            cuts = sorted(set(torch.randint(1, n, (4,), generator=g).tolist()))
            bounds = [0, *cuts, n] if attempt < 3 else list(range(n + 1))  # last: decode rows
            for a, b in zip(bounds, bounds[1:]):
                other_q = int(torch.randint(1, 40, (), generator=g))
                rows = torch.cat([caches.queries(1), query[a:b], caches.queries(other_q)])
                out = caches.run(rows, [1, 0, 2], [1, b - a, other_q], [60, b, 200])
                assert torch.equal(out[1 : 1 + b - a], whole[a:b]), (attempt, a, b)
    finally:
        torch.set_num_threads(threads)
    # And the single-sequence op is the same kernel.
    single = cpu_ops.prefill_attention(query, caches.key, caches.value, caches.tables[0], n,
                                       caches.scale, **caches.scales)
    assert torch.equal(single, whole)


def test_empty_and_zero_length_sequences() -> None:
    caches = Caches([20, 20], 9, 3, 64, 16, False, seed=4)
    query = caches.queries(3)
    out = caches.run(query, [0, 1], [0, 3], [20, 20])  # the first sequence has no queries
    torch.testing.assert_close(out.float(), caches.reference(query, [0, 1], [0, 3], [20, 20]).float(),
                               atol=2e-2, rtol=2e-2)
    empty = caches.queries(0)
    assert caches.run(empty, [], [], []).shape == (0, 9, 64)


def test_rejects_bad_inputs() -> None:
    caches = Caches([40], 9, 3, 64, 16, False, seed=5)
    query = caches.queries(4)

    def call(starts, lens, tables=caches.tables, q=query):
        cpu_ops.varlen_attention(q, caches.key, caches.value, tables,
                                 torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), 0.1)

    with pytest.raises(RuntimeError, match="from 0 to the number of query rows"):
        call([0, 3], [40])
    with pytest.raises(RuntimeError, match="must be >= the queries and fit the block table"):
        call([0, 4], [3])
    with pytest.raises(RuntimeError, match="must be >= the queries and fit the block table"):
        call([0, 4], [10_000])
    with pytest.raises(RuntimeError, match=r"int32 \[num_seqs, max_blocks\]"):
        call([0, 4], [40], tables=caches.tables.long())
    with pytest.raises(RuntimeError, match="bfloat16"):
        call([0, 4], [40], q=query.float())
