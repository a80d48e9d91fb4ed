"""Slots past a sequence's context must not reach the attention output, whatever they hold.

A freed block is reused without being cleared, and the rows of a sequence's last block past
its context (and the blocks its table's spare columns name) hold whatever was there: NaN too
(a request whose activations overflowed). Masked attention gives those keys weight 0, but
0 * NaN is NaN, so each path must keep them out, not just weigh them 0.
"""

from __future__ import annotations

import pytest
import torch
from argosy_runtime.attention import AttentionMetadata, TorchAttentionBackend
from kernel_test_utils import dense_kv, generator, naive_attention


def _poisoned_decode_batch(softcap: float | None):
    g = generator(4)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    lens = [20, 33, 1]
    kc = torch.randn(12, block_size, kv_heads, head_dim, generator=g)
    vc = torch.randn(12, block_size, kv_heads, head_dim, generator=g)
    # Blocks 1..: the sequences' own; block 0: what their spare columns name.
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]], dtype=torch.int32)
    kc[0], vc[0] = float("inf"), float("nan")
    for s, n in enumerate(lens):
        for t in range(n, tables.shape[1] * block_size):
            b = int(tables[s, t // block_size])
            kc[b, t % block_size], vc[b, t % block_size] = float("nan"), float("nan")
    query = torch.randn(len(lens), heads, head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(lens),), -1), num_decodes=len(lens),
        decode_block_tables=tables, decode_context_lens=torch.tensor(lens, dtype=torch.int32),
        prefill_query_lens=[], prefill_seq_lens=[], prefill_block_tables=tables[:0],
    )
    scale = head_dim**-0.5
    want = torch.stack([
        naive_attention(query[s], dense_kv(kc, tables[s], n), dense_kv(vc, tables[s], n), scale)
        if softcap is None else
        _naive_softcap(query[s], dense_kv(kc, tables[s], n), dense_kv(vc, tables[s], n), scale,
                       softcap)
        for s, n in enumerate(lens)
    ])
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, scale, fused_cpu_ops=False)
    return backend, query, kc, vc, meta, want


def _naive_softcap(q, k, v, scale, softcap):
    group = q.shape[0] // k.shape[1]
    out = []
    for h in range(q.shape[0]):
        s = (k[:, h // group] @ q[h].double()) * scale
        out.append(torch.softmax(torch.tanh(s / softcap) * softcap, dim=0) @ v[:, h // group])
    return torch.stack(out)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_backend_decode_ignores_padded_slots(softcap):
    """The PyTorch decode path (no C++ kernels) gathers whole blocks for SDPA."""
    backend, query, kc, vc, meta, want = _poisoned_decode_batch(softcap)
    got = backend._decode_attention(query, kc, vc, meta, softcap=softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
