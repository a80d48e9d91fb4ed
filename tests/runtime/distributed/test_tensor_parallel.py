"""Tensor-parallel sharding rules (no processes): the shard's shape and each weight's slice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from argosy_runtime.distributed import ShardedCheckpoint, shard_spec, shard_tensor
from argosy_runtime.model_loader import load_checkpoint


@pytest.fixture(scope="module")
def embedded():
    return load_checkpoint("smollm2-135m")


def test_shard_spec_divides_heads_kv_heads_and_mlp(embedded) -> None:
    spec = embedded.spec  # 9 heads, 3 KV heads, 1536 MLP columns
    shard = shard_spec(spec, 3)
    assert (shard.num_attention_heads, shard.num_key_value_heads, shard.intermediate_size) == (3, 1, 512)
    assert (shard.hidden_size, shard.head_dim, shard.vocab_size) == (spec.hidden_size, spec.head_dim,
                                                                   spec.vocab_size)
    assert shard.attention_scale == spec.attention_scale  # head_dim ** -0.5, not per shard


def test_uneven_split_names_what_does_not_divide(embedded) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads 9, num_key_value_heads 3"):
        shard_spec(embedded.spec, 2)
    with pytest.raises(ValueError, match="positive integer"):
        shard_spec(embedded.spec, 0)


def test_fewer_kv_heads_than_ranks_are_replicated(embedded) -> None:
    # 12 heads, 3 KV heads (groups of 4 query heads) over 6 ranks: two query heads and one KV
    # head each, every KV head on the 2 ranks whose query heads read it. 4 ranks do not
    # divide the 3 KV heads.
    spec = dataclasses.replace(embedded.spec, num_attention_heads=12, num_key_value_heads=3)
    assert shard_spec(spec, 6).num_key_value_heads == 1
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        shard_spec(spec, 4)
    k = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3 * 4, 2)  # 3 heads of dim 4
    heads = k.chunk(3)
    for rank in range(6):  # query heads 2r, 2r + 1: KV group r // 2
        assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.weight", k, rank, 6,
                                        num_kv_heads=3), heads[rank // 2])
        assert torch.equal(shard_tensor("model.layers.0.self_attn.v_proj.bias", k[:, 0], rank, 6,
                                        num_kv_heads=3), heads[rank // 2][:, 0])
    q = torch.randn(12 * 4, 2)  # still split by rank
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", q, 4, 6,
                                    num_kv_heads=3), q.chunk(6)[4])


@pytest.mark.parametrize("name, dim", [
    ("model.layers.0.self_attn.q_proj.weight", 0),
    ("model.layers.0.self_attn.k_proj.bias", 0),
    ("model.layers.3.mlp.up_proj.weight", 0),
    ("model.layers.1.mlp.experts.5.gate_proj.weight", 0),
    ("model.layers.1.block_sparse_moe.experts.2.w3.weight", 0),
    ("model.layers.0.self_attn.o_proj.weight", 1),
    ("model.layers.2.mlp.shared_expert.down_proj.weight", 1),
    ("model.layers.1.block_sparse_moe.experts.2.w2.weight", 1),
])
def test_split_projections_reassemble(name: str, dim: int) -> None:
    tensor = torch.randn(12, 8) if name.endswith("weight") else torch.randn(12)
    shards = [shard_tensor(name, tensor, rank, 4) for rank in range(4)]
    assert all(s.shape[dim] == tensor.shape[dim] // 4 for s in shards)
    assert torch.equal(torch.cat(shards, dim=dim), tensor)


@pytest.mark.parametrize("name", [
    "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
    "model.layers.1.mlp.gate.weight",  # the MoE router
    "model.layers.1.mlp.shared_expert_gate.weight", "score.weight",
])
def test_other_weights_are_replicated(name: str) -> None:
    tensor = torch.randn(12, 8)
    assert shard_tensor(name, tensor, 1, 4) is tensor


def test_row_parallel_bias_is_refused() -> None:
    with pytest.raises(ValueError, match="row-parallel"):
        shard_tensor("model.layers.0.self_attn.o_proj.bias", torch.randn(8), 0, 2)


def test_sharded_checkpoint_streams_each_ranks_slices(embedded) -> None:
    ranks = [dict(ShardedCheckpoint(embedded, r, 3).iter_weights()) for r in range(3)]
    full = dict(embedded.iter_weights())
    assert ranks[0].keys() == full.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([w[q] for w in ranks], dim=0), full[q])
    assert torch.equal(torch.cat([w[o] for w in ranks], dim=1), full[o])
    assert all(w[o].is_contiguous() for w in ranks)
    assert torch.equal(ranks[2]["model.norm.weight"], full["model.norm.weight"])
    assert ShardedCheckpoint(embedded, 1, 3).tokenizer is embedded.tokenizer
