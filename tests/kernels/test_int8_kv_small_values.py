"""int8 KV cache with float16 activations and small values: the kernels' value weights must
not lose digits to float16's subnormal range.

A head whose values are all below ~8e-3 stores v_scale < 6e-5; the kernels fold v_scale into
the softmax weights before a float16 dot, where p * v_scale (p <= 1) then lands among float16
subnormals (a few significant bits) unless it is kept relative to the tile's largest scale.
The references dequantize in float32, so the comparison is with float64 attention over the
same dequantized cache, relative to the output's size (the absolute float16 tolerance would
hide it: the outputs are ~1e-4).
"""

from __future__ import annotations

import torch
from argosy_kernels.paged_attention import paged_decode_attention
from argosy_kernels.paged_prefill_attention import paged_prefill_attention
from argosy_kernels.reshape_and_cache import quantize_per_head_ref
from kernel_test_utils import DEVICE, dense_kv, generator, naive_attention, random_block_tables

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16


def _cache(lens: list[int], seed: int):
    g = generator(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 2
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kq, ks = quantize_per_head_ref(torch.randn(shape, generator=g))
    vq, vs = quantize_per_head_ref(torch.randn(shape, generator=g) * 1e-4)
    assert vs.float().max() < 6e-5  # every value scale is a float16 subnormal
    tables = random_block_tables(lens, BLOCK_SIZE, num_blocks, g)
    caches = [t.to(DEVICE) for t in (kq, vq)]
    return caches, {"k_scale": ks.to(DEVICE), "v_scale": vs.to(DEVICE)}, tables, g


def _assert_relative(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert err < 2e-3, f"relative error {float(err):.2e}"  # float16: a few ulps


def test_decode_small_values():
    lens = [70, 33]
    (kq, vq), scales, tables, g = _cache(lens, seed=1)
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g).half().to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(query, kq, vq, tables, ctx, HEAD_DIM**-0.5, **scales)
    for s, n in enumerate(lens):
        k = dense_kv(kq, tables[s], n, scales["k_scale"])
        v = dense_kv(vq, tables[s], n, scales["v_scale"])
        _assert_relative(got[s], naive_attention(query[s], k, v, HEAD_DIM**-0.5))


def test_prefill_small_values():
    seq_len, q_len = 40, 24
    (kq, vq), scales, tables, g = _cache([seq_len], seed=2)
    query = torch.randn(q_len, HEADS, HEAD_DIM, generator=g).half().to(DEVICE)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(query, kq, vq, tables, qsl, lens, HEAD_DIM**-0.5, **scales)
    k = dense_kv(kq, tables[0], seq_len, scales["k_scale"])
    v = dense_kv(vq, tables[0], seq_len, scales["v_scale"])
    for i in range(q_len):  # row i sits at position seq_len - q_len + i
        n = seq_len - q_len + i + 1
        _assert_relative(got[i], naive_attention(query[i], k[:n], v[:n], HEAD_DIM**-0.5))
