"""The CPU attention backend (also the torch reference for the Triton backend on CUDA).

Where the fused C++ kernels build (argosy_kernels.cpu_ops): cache writes and decode attention
through them, and a step's bfloat16 prompt chunks through one `cpu_ops.varlen_attention` call
where the CPU has AVX512-BF16. Everything else, and every path on CUDA, is PyTorch: SDPA per
prompt chunk. In the batch-invariant mode every query goes through `cpu_ops.varlen_attention`.

`forward(..., sliding_window=W)` (a sliding-window layer): a query at position p sees only the
keys p - W < k <= p, on every path; None (the default) is full causal attention.
`forward(..., softcap=C)` (Gemma 2's attn_logit_softcapping): every scaled score s becomes
C * tanh(s / C) before the mask and softmax, on every path: the C++ kernels cap in place; the
PyTorch paths, where SDPA cannot, compute transformers' eager attention (`_softcap_attention`).
None (the default) leaves every path as it was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops
from argosy_kernels.reshape_and_cache import reshape_and_cache_ref

from argosy_runtime.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 fused_cpu_ops: bool | None = None, batch_invariant: bool = False) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Decode attention through the fused C++ kernel where it builds (None: when available).
        self.fused_cpu_ops = cpu_ops.available() if fused_cpu_ops is None else fused_cpu_ops
        # bfloat16 prompt chunks through the C++ flash kernel where the CPU has AVX512-BF16
        # and the kernel takes the shapes (it refuses others: a GQA group above 16 failed).
        self.bf16_prefill_kernel = (self.fused_cpu_ops and cpu_ops.has_avx512_bf16()
                                    and cpu_ops.varlen_shapes_supported(head_dim, num_heads,
                                                                        num_kv_heads))
        # Every query, decode rows included, through the one kernel whose result for a query
        # does not depend on the rest of the batch (argosy_runtime/batch_invariance.py); the
        # batch then has no decode rows (the model's decode_rows_up_to is 0).
        self.batch_invariant = batch_invariant

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
        v_scale: torch.Tensor | None = None,  # (int8 cache only)
        sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as is
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # All new K/V are written before any attention reads, so a sequence may read blocks
        # another sequence writes in this same step (same-step prefix-cache hits).
        if self.fused_cpu_ops and key.device.type == "cpu":
            cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping,
                                      k_scale=k_scale, v_scale=v_scale)
        else:
            reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping,
                                  k_scale=k_scale, v_scale=v_scale)
        nd = meta.num_decodes
        if self.batch_invariant:
            if nd:
                raise ValueError("batch-invariant attention takes no decode rows: build the "
                                 "batch with decode_rows_up_to=0")
            return cpu_ops.varlen_attention(query, key_cache, value_cache,
                                            *meta.prefill_sequences(), self.scale,
                                            k_scale=k_scale, v_scale=v_scale,
                                            sliding_window=sliding_window, softcap=softcap)
        if nd and nd == query.shape[0]:  # decodes only: no output buffer to assemble
            return self._decode_attention(query, key_cache, value_cache, meta, k_scale, v_scale,
                                          sliding_window, softcap)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode_attention(query[:nd], key_cache, value_cache, meta,
                                              k_scale, v_scale, sliding_window, softcap)
        if (self.bf16_prefill_kernel and query.dtype == torch.bfloat16
                and query.device.type == "cpu" and key_cache.dtype in (torch.bfloat16, torch.int8)):
            # Every chunk in one call, straight over the cache blocks, their own K/V included.
            cpu_ops.varlen_attention(query[nd:], key_cache, value_cache, *meta.prefill_sequences(),
                                     self.scale, k_scale=k_scale, v_scale=v_scale, out=out[nd:],
                                     sliding_window=sliding_window, softcap=softcap)
            return out
        start = nd
        block_size = key_cache.shape[1]
        for i, (q_len, seq_len) in enumerate(zip(meta.prefill_query_lens, meta.prefill_seq_lens)):
            end = start + q_len
            num_context = seq_len - q_len
            # Keys before the first query's window are seen by no query: not read (block-wise).
            first_key = 0 if sliding_window is None else max(0, num_context - sliding_window + 1)
            if num_context == 0 and k_scale is None:
                k, v = key[start:end], value[start:end]
            else:
                # The chunk's own K/V are read back from the cache with the prefix: an int8
                # cache then gives a prompt the same quantized values whether its first tokens
                # were computed in this chunk, an earlier one, or found in the prefix cache, so
                # neither a cache hit nor the chunk size changes outputs.
                first_block = first_key // block_size
                blocks = meta.prefill_block_tables[i, first_block: -(-seq_len // block_size)].long()
                rows = slice(first_key - first_block * block_size, seq_len - first_block * block_size)
                k = key_cache[blocks].flatten(0, 1)[rows]
                v = value_cache[blocks].flatten(0, 1)[rows]
                if k_scale is not None and v_scale is not None:  # dequantize the int8 cache
                    k = k.float() * k_scale[blocks].flatten(0, 1)[rows, :, None].float()
                    v = v.float() * v_scale[blocks].flatten(0, 1)[rows, :, None].float()
            out[start:end] = self._causal_attention(query[start:end], k, v, num_context - first_key,
                                                    sliding_window, softcap)
            start = end
        return out

    def _decode_attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, meta: AttentionMetadata,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          sliding_window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
        """The CPU fast path of `paged_decode_attention_ref` (same result, tested against it).

        With the fused C++ kernels (argosy_kernels.cpu_ops): one pass per (sequence, kv head)
        straight over the cache blocks, 2.5-6x faster than the PyTorch path below. Without
        them: one index_select gathers whole blocks (much faster than advanced indexing); the
        mask and block list are built once per step and shared by all layers. The G query heads
        that share a kv head become G query rows of one SDPA call over strided K/V views:
        PyTorch's fused CPU attention kernel reads the strides, so nothing is transposed or
        repeated per kv head (2-3.5x faster than two batched GEMMs on contiguous copies here).
        """
        if self.fused_cpu_ops and query.device.type == "cpu":
            return cpu_ops.decode_attention(query, key_cache, value_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, self.scale,
                                            k_scale=k_scale, v_scale=v_scale,
                                            sliding_window=sliding_window, softcap=softcap)
        flat_blocks, padded_len, valid = _decode_gather_plan(meta, key_cache.shape[1], sliding_window)
        num_seqs = query.shape[0]
        kvh, hd = self.num_kv_heads, self.head_dim
        keys = key_cache.index_select(0, flat_blocks)  # [num_seqs * blocks, block_size, kvh, hd]
        values = value_cache.index_select(0, flat_blocks)
        if k_scale is not None and v_scale is not None:  # dequantize the int8 cache (fp16 scales)
            keys = (keys.float() * k_scale.index_select(0, flat_blocks).float()[..., None]).to(query.dtype)
            values = (values.float() * v_scale.index_select(0, flat_blocks).float()[..., None]).to(query.dtype)
        # Slots past a context (the rest of its last block, spare table columns) may hold
        # anything, NaN included (a reused block), and SDPA's masking does not stop NaN: it
        # adds -inf to a NaN score, and a masked weight of 0 times a NaN value is NaN.
        pad = ~valid.view(num_seqs, padded_len, 1, 1)
        # [num_seqs, kv_heads, padded_len, head_dim], strided
        keys = keys.view(num_seqs, padded_len, kvh, hd).masked_fill(pad, 0.0).transpose(1, 2)
        values = values.view(num_seqs, padded_len, kvh, hd).masked_fill(pad, 0.0).transpose(1, 2)
        q = query.view(num_seqs, kvh, self.num_heads // kvh, hd)
        if softcap is not None:
            out = _softcap_attention(q, keys, values, valid, self.scale, softcap)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid, scale=self.scale)
        return out.reshape(num_seqs, self.num_heads, hd)

    def _causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int,
        sliding_window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        # q: [q_len, H, D]; k, v: [seq_len, KVH, D]; query i sits at position num_context + i
        # (positions counted from k's first key).
        q_len, seq_len = q.shape[0], k.shape[0]
        k, v = k.to(q.dtype), v.to(q.dtype)
        # A window that hides no key from any query (the last one's reaches key 0) is no window.
        windowed = sliding_window is not None and seq_len > sliding_window
        if num_context and q.device.type == "cpu" and not windowed and softcap is None:
            return self._chunk_after_prefix_cpu(q, k, v, num_context)
        mask = None
        if num_context or windowed or softcap is not None:
            positions = torch.arange(seq_len, device=q.device)
            q_pos = (num_context + torch.arange(q_len, device=q.device))[:, None]
            mask = positions[None, :] <= q_pos
            if windowed:
                mask &= positions[None, :] > q_pos - sliding_window
        if softcap is not None:
            out = _softcap_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask,
                                     self.scale, softcap)
            return out.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)

    def _chunk_after_prefix_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int
    ) -> torch.Tensor:
        """A prompt chunk after `num_context` cached tokens, as two unmasked flash-attention
        calls merged by their log-sum-exp: the whole chunk against the prefix, then the chunk
        against itself (causal, square). With a boolean mask PyTorch's CPU kernel scores every
        (query, key) pair and reads the mask; this skips the masked half and the mask, 1.3-1.4x
        faster at 3.5k cached tokens (bf16, SmolLM2 shapes)."""
        q_len, num_heads, head_dim = q.shape
        kv_heads = self.num_kv_heads
        group = num_heads // kv_heads
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        # Against the prefix no query is masked, so the `group` query heads of a kv head can
        # be stacked as rows of one head: bigger tiles, no K/V repeated per query head.
        grouped = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        grouped = grouped.reshape(1, kv_heads, group * q_len, head_dim)
        prefix_k = k[:num_context].transpose(0, 1).unsqueeze(0)
        prefix_v = v[:num_context].transpose(0, 1).unsqueeze(0)
        out_p, lse_p = flash(grouped, prefix_k, prefix_v, 0.0, False, scale=self.scale)
        out_p = out_p.reshape(num_heads, q_len, head_dim)  # head kvh * group + g
        lse_p = lse_p.reshape(num_heads, q_len, 1)
        chunk_k = k[num_context:].transpose(0, 1).unsqueeze(0)
        chunk_v = v[num_context:].transpose(0, 1).unsqueeze(0)
        out_c, lse_c = flash(q.transpose(0, 1).unsqueeze(0), chunk_k, chunk_v, 0.0, True,
                             scale=self.scale)
        out_c, lse_c = out_c.squeeze(0), lse_c.reshape(num_heads, q_len, 1)
        lse = torch.logaddexp(lse_p, lse_c)
        out = out_p.float() * (lse_p - lse).exp() + out_c.float() * (lse_c - lse).exp()
        return out.to(q.dtype).transpose(0, 1)


def _softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float, softcap: float) -> torch.Tensor:
    """Soft-capped attention in transformers' eager order (Gemma 2): scores = q.k * scale,
    softcap * tanh(scores / softcap), masked, softmax in float32 rounded to q's dtype, times v.
    q: [..., H, Lq, D]; k, v: [..., KVH, Lk, D] (query heads h read kv head h // (H / KVH));
    mask: boolean, broadcast to [..., H, Lq, Lk], True where a key is seen."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.to(q.dtype))


def _decode_gather_plan(meta: AttentionMetadata, block_size: int,
                        sliding_window: int | None = None
                        ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Per step and window (cached on the metadata): the blocks to gather, the padded context
    length and a boolean mask [num_decodes, 1, 1, padded_len] (True inside each context, and
    inside its last `sliding_window` keys)."""
    plans = getattr(meta, "_cpu_decode_plans", None)
    if plans is None:
        plans = meta._cpu_decode_plans = {}  # type: ignore[attr-defined]
    plan = plans.get(sliding_window)
    if plan is None:
        lens = meta.decode_context_lens.long()
        num_blocks = -(-int(lens.max()) // block_size)
        padded_len = num_blocks * block_size
        flat_blocks = meta.decode_block_tables[:, :num_blocks].long().flatten()
        positions = torch.arange(padded_len, device=lens.device)
        valid = positions[None, :] < lens[:, None]
        if sliding_window is not None:
            valid &= positions[None, :] >= lens[:, None] - sliding_window
        plan = (flat_blocks, padded_len, valid[:, None, None, :])
        plans[sliding_window] = plan
    return plan
