"""A tiny random Llama and hand-built attention metadata, for the backend / graph-runner tests."""

from __future__ import annotations

import torch
from argosy_runtime.attention import AttentionMetadata
from argosy_runtime.model_loader.model_spec import ModelSpec
from argosy_runtime.models.llama import ForwardContext, LlamaForCausalLM

BLOCK_SIZE = 16


def tiny_spec(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
              head_dim: int = 16, intermediate: int = 128, vocab: int = 128,
              max_positions: int = 1024) -> ModelSpec:
    return ModelSpec(
        architecture="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=max_positions, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=None, eos_token_ids=(0,), checkpoint_dtype="float32",
    )


def random_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(spec, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model.to(device).eval()


def kv_caches(spec: ModelSpec, num_blocks: int, dtype: torch.dtype, device: torch.device):
    shape = (spec.num_hidden_layers, 2, num_blocks, BLOCK_SIZE, spec.num_key_value_heads,
             spec.head_dim)
    kv = torch.zeros(shape, dtype=dtype, device=device)
    return kv, [(kv[i, 0], kv[i, 1]) for i in range(spec.num_hidden_layers)]


def build_step(seqs: list[tuple[list[int], list[int], int, int]], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """seqs: (token_ids, block_ids, num_computed, num_new) per sequence, decodes first.
    Mirrors ModelRunner._prepare: returns input_ids, positions, metadata."""
    ids, pos, slots = [], [], []
    dec_tables, dec_lens, pre_tables, q_lens, seq_lens = [], [], [], [], []
    for tokens, blocks, start, n in seqs:
        end = start + n
        ids += tokens[start:end]
        p = list(range(start, end))
        pos += p
        slots += [blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in p]
        if n == 1:
            dec_tables.append(blocks)
            dec_lens.append(end)
        else:
            pre_tables.append(blocks)
            q_lens.append(n)
            seq_lens.append(end)

    def table(rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=1)
        out = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(device)

    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(dec_lens),
        decode_block_tables=table(dec_tables),
        decode_context_lens=torch.tensor(dec_lens, dtype=torch.int32, device=device),
        prefill_query_lens=q_lens,
        prefill_seq_lens=seq_lens,
        prefill_block_tables=table(pre_tables),
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        prefill_seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
    return (torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device), meta)


def forward(model: LlamaForCausalLM, backend, caches, step, scales=None) -> torch.Tensor:
    ids, pos, meta = step
    with torch.inference_mode():
        return model(ids, pos, ForwardContext(model.rotary, backend, caches, meta, scales))
