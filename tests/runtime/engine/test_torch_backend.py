"""The CPU attention backend against the pure-torch references, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.paged_attention import paged_decode_attention_ref
from argosy_kernels.reshape_and_cache import quantize_per_head_ref
from argosy_runtime.attention import AttentionMetadata, TorchAttentionBackend


def _random_case(num_seqs: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                 block_size: int = 16, seed: int = 0):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    num_blocks, head_dim = 64, 64
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.randint(1, 5 * block_size, (num_seqs,), generator=gen)
    lens[0] = block_size  # exactly on a block boundary
    if num_seqs > 1:
        lens[1] = 1
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:6] for _ in range(num_seqs)])
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, tables.int(), lens.int()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_decode_fast_path_equals_reference(dtype: torch.dtype, tol: float, num_heads: int,
                                           num_kv_heads: int) -> None:
    query, kc, vc, tables, lens = _random_case(7, num_heads, num_kv_heads, dtype)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, 64, 0.125)
    got = backend._decode_attention(query, kc, vc, _decode_meta(tables, lens))
    want = paged_decode_attention_ref(query, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _decode_meta(tables: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(lens),
        decode_block_tables=tables, decode_context_lens=lens,
        prefill_query_lens=[], prefill_seq_lens=[],
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
def test_decode_fast_path_on_an_int8_cache_equals_reference(dtype: torch.dtype, tol: float,
                                                            num_heads: int, num_kv_heads: int) -> None:
    query, kc, vc, tables, lens = _random_case(5, num_heads, num_kv_heads, torch.float32, seed=3)
    qk, k_scale = quantize_per_head_ref(kc)
    qv, v_scale = quantize_per_head_ref(vc)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, 64, 0.125)
    got = backend._decode_attention(query.to(dtype), qk, qv, _decode_meta(tables, lens),
                                    k_scale, v_scale)
    want = paged_decode_attention_ref(query.to(dtype), qk, qv, tables, lens, 0.125,
                                      k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
