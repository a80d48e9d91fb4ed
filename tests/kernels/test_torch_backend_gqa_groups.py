"""TorchAttentionBackend prompt chunks with a GQA group the C++ flash kernel does not take.

In bfloat16 on a CPU with AVX512-BF16 the backend sends prompt chunks to
`cpu_ops.varlen_attention`, which refuses more than 16 query heads per kv head (a
multi-query checkpoint: 32 heads on one kv head): those chunks must take the PyTorch path,
not raise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from argosy_runtime.attention import TorchAttentionBackend
from argosy_runtime.attention.batch import build_batch
from kernel_test_utils import dense_kv, generator, naive_attention


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 1), (16, 1)])
def test_bf16_prompt_chunks_with_any_gqa_group(num_heads, num_kv_heads):
    head_dim, block_size = 64, 16
    g = generator(6)
    # A prompt after 5 cached tokens (prefix hit), and a fresh prompt.
    entries = [(np.array([1, 2]), 5, list(range(14))), (np.array([3]), 0, list(range(9)))]
    _, _, meta = build_batch(entries, block_size, torch.device("cpu"))
    shape = (4, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).bfloat16()
    value_cache = torch.randn(shape, generator=g).bfloat16()
    tokens = sum(len(t) for _, _, t in entries)
    query = torch.randn(tokens, num_heads, head_dim, generator=g).bfloat16()
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=g).bfloat16()
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    out = backend.forward(query, key, value, key_cache, value_cache, meta)
    row = 0
    for blocks, start, chunk in entries:  # the cache now holds each chunk's K/V
        table = torch.tensor(blocks)
        for i in range(len(chunk)):
            k = dense_kv(key_cache, table, start + i + 1)
            v = dense_kv(value_cache, table, start + i + 1)
            want = naive_attention(query[row], k, v, scale)
            torch.testing.assert_close(out[row].double(), want, atol=3e-2, rtol=3e-2)
            row += 1
