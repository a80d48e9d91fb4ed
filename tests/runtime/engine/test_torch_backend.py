"""The CPU attention backend against the pure-torch references, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels import cpu_ops
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


def test_forward_on_an_int8_cache_reads_float16_scales() -> None:
    """One decode and one prefill chunk with cached context, through `forward` on an int8
    cache: both dequantize with the float16 scales exactly like the paged references."""
    from argosy_kernels.paged_prefill_attention import paged_prefill_attention_ref
    from argosy_kernels.reshape_and_cache import reshape_and_cache_ref

    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 64, 16, 12
    kq = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8)
    vq = torch.zeros_like(kq)
    ks = torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float16)
    vs = torch.zeros_like(ks)
    # Sequence 0 decodes its token 21; sequence 1 prefills tokens 35..43 after 35 cached ones.
    tables = torch.tensor([[3, 7, 0], [5, 1, 9]], dtype=torch.int32)
    ctx = (21, 35)

    def slots(s: int, positions: range) -> torch.Tensor:
        return torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                             for p in positions])

    for s, n in enumerate(ctx):  # the earlier tokens, already cached
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) for _ in range(2))
        reshape_and_cache_ref(k, v, kq, vq, slots(s, range(n)), k_scale=ks, v_scale=vs)
    new = 1 + 9
    query = torch.randn(new, num_heads, head_dim, generator=gen)
    key, value = (torch.randn(new, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots(0, range(21, 22)), slots(1, range(35, 44))]),
        num_decodes=1, decode_block_tables=tables[:1],
        decode_context_lens=torch.tensor([22], dtype=torch.int32),
        prefill_query_lens=[9], prefill_seq_lens=[44], prefill_block_tables=tables[1:],
    )
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, 0.125)
    got = backend.forward(query, key, value, kq, vq, meta, k_scale=ks, v_scale=vs)
    assert ks.dtype == vs.dtype == torch.float16 and bool((ks[5, 0] > 0).all())
    want_decode = paged_decode_attention_ref(query[:1], kq, vq, tables[:1], meta.decode_context_lens,
                                             0.125, k_scale=ks, v_scale=vs)
    want_prefill = paged_prefill_attention_ref(
        query[1:], kq, vq, tables[1:], torch.tensor([0, 9], dtype=torch.int32),
        torch.tensor([44], dtype=torch.int32), 0.125, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got[:1], want_decode, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:], want_prefill, rtol=1e-5, atol=1e-5)


def test_int8_cache_runner_allocates_float16_scales_and_counts_them() -> None:
    """The runner's int8 cache keeps one float16 scale per token per kv head for K and for V,
    and `kv_cache_bytes_per_block` (what sizes the cache) counts exactly what it allocates."""
    from argosy_runtime.config import CacheConfig
    from argosy_runtime.kv_cache import KVCacheManager
    from argosy_runtime.model_loader import ModelSpec
    from argosy_runtime.model_runner import ModelRunner, kv_cache_bytes_per_block
    from argosy_runtime.models.llama import LlamaForCausalLM

    layers, kv_heads, head_dim, block_size, num_blocks = 2, 3, 64, 16, 5
    spec = ModelSpec(
        architecture="llama", vocab_size=64, hidden_size=192, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=3, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=None, eos_token_ids=(0,), checkpoint_dtype="bfloat16",
    )
    model = LlamaForCausalLM(spec, dtype=torch.bfloat16)
    per_token = {}
    for dtype in (torch.bfloat16, torch.int8):
        runner = ModelRunner(model, CacheConfig(block_size, num_blocks, dtype, False),
                             KVCacheManager(num_blocks, block_size, False), torch.device("cpu"),
                             spec.vocab_size)
        allocated = runner.kv.nbytes
        if dtype == torch.int8:
            assert runner.scales.dtype == torch.float16
            assert runner.scales.shape == (layers, 2, num_blocks, block_size, kv_heads)
            assert all(k.dtype == v.dtype == torch.float16 for k, v in runner.kv_scales)
            allocated += runner.scales.nbytes
        assert kv_cache_bytes_per_block(model, block_size, dtype) * num_blocks == allocated
        per_token[dtype] = allocated / (num_blocks * block_size)
    assert per_token[torch.bfloat16] == 2 * layers * kv_heads * head_dim * 2
    assert per_token[torch.int8] == 2 * layers * kv_heads * (head_dim + 2)
    assert per_token[torch.bfloat16] / per_token[torch.int8] >= 1.9


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_prefill_chunks_after_cached_prefixes_equal_reference(dtype: torch.dtype, tol: float,
                                                              num_heads: int,
                                                              num_kv_heads: int) -> None:
    """Chunks of 1, 16 and 23 new tokens after 1, 16 (a block boundary) and 50 cached ones,
    plus a fresh prompt, in one step: the CPU path (two flash-attention calls merged by
    log-sum-exp) against the paged reference's masked float32 attention."""
    from argosy_kernels.paged_prefill_attention import paged_prefill_attention_ref

    gen = torch.Generator().manual_seed(5)
    head_dim, block_size, num_blocks = 64, 16, 24
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_lens, seq_lens = [1, 16, 23, 12], [2, 32, 73, 12]
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:5] for _ in q_lens]).int()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(starts[-1])
    query = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                          for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens))
                          for p in range(seq_len - q_len, seq_len)])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=0, decode_block_tables=tables[:0],
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_query_lens=q_lens, prefill_seq_lens=seq_lens, prefill_block_tables=tables,
    )
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, 0.125)
    # bfloat16 runs the C++ flash kernel where the CPU has AVX512-BF16, float32 PyTorch's.
    assert backend.bf16_prefill_kernel == cpu_ops.has_avx512_bf16()
    got = backend.forward(query, key, value, kc, vc, meta)  # writes the chunks' K/V first
    want = paged_prefill_attention_ref(query, kc, vc, tables, starts,
                                       torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_fresh_prompt_on_an_int8_cache_attends_to_what_a_cache_hit_would_read() -> None:
    """With an int8 KV cache, a prompt computed with nothing cached (one chunk) must attend to
    the same quantized K/V as when its first tokens come from the prefix cache (or an earlier
    chunk): else a prefix-cache hit, or another chunk size, changes greedy outputs. Both equal
    the paged reference over the int8 cache; before, the fresh prompt used the unquantized K/V."""
    from argosy_kernels.paged_prefill_attention import paged_prefill_attention_ref
    from argosy_kernels.reshape_and_cache import reshape_and_cache_ref

    gen = torch.Generator().manual_seed(23)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 8
    n, cached = 40, 32  # a prompt of 40 tokens; a hit covers its first 2 blocks
    query = torch.randn(n, num_heads, head_dim, generator=gen)
    key, value = (torch.randn(n, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    table = torch.tensor([[4, 1, 6]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size
                          for p in range(n)])
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, 0.125)

    def run(first: int) -> torch.Tensor:
        """Attention of tokens first..n-1 with tokens 0..first-1 already in the cache."""
        kq = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8)
        vq = torch.zeros_like(kq)
        ks = torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float16)
        vs = torch.zeros_like(ks)
        reshape_and_cache_ref(key[:first], value[:first], kq, vq, slots[:first],
                              k_scale=ks, v_scale=vs)
        meta = AttentionMetadata(
            slot_mapping=slots[first:], num_decodes=0, decode_block_tables=table[:0],
            decode_context_lens=torch.zeros(0, dtype=torch.int32),
            prefill_query_lens=[n - first], prefill_seq_lens=[n], prefill_block_tables=table)
        got = backend.forward(query[first:], key[first:], value[first:], kq, vq, meta,
                              k_scale=ks, v_scale=vs)
        want = paged_prefill_attention_ref(
            query[first:], kq, vq, table, torch.tensor([0, n - first], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32), 0.125, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return got

    fresh, after_hit = run(0), run(cached)
    torch.testing.assert_close(fresh[cached:], after_hit, rtol=1e-5, atol=1e-5)
