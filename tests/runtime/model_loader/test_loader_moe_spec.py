"""ModelSpec of Mixture-of-Experts configs (Mixtral, Qwen2-MoE, Qwen3-MoE): the expert fields,
which layers are sparse, and clear errors for inconsistent ones."""

from __future__ import annotations

import dataclasses

import pytest
from argosy_runtime.model_loader import ModelSpec
from argosy_runtime.model_loader.hf_checkpoint import expected_weight_names

# mistralai/Mixtral-8x7B-v0.1's config.json as published (transformers 4.x layout).
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}
# Qwen/Qwen3-30B-A3B's config.json as published.
QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
# Qwen/Qwen1.5-MoE-A2.7B's config.json as published (no qkv_bias field: the bias is implied).
QWEN2_MOE_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"], "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}


def spec(config: dict, **changes) -> ModelSpec:  # noqa: ANN003
    return ModelSpec.from_hf_config({**config, **changes}, checkpoint_dtype="bfloat16")


def test_mixtral_every_layer_sparse_top_k_renormalized() -> None:
    s = spec(MIXTRAL_CONFIG)
    assert s.architecture == "mixtral" and s.is_moe and not s.qk_norm and not s.attention_bias
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (8, 2, 14336)
    assert s.norm_topk_prob and s.router_weights_in_float32
    assert s.sparse_layers == tuple(range(32)) and s.shared_expert_intermediate_size == 0
    names = expected_weight_names(s)
    assert "model.layers.31.block_sparse_moe.experts.7.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)


def test_qwen3_moe_has_qk_norm_and_follows_norm_topk_prob() -> None:
    s = spec(QWEN3_MOE_CONFIG)
    assert s.architecture == "qwen3_moe" and s.qk_norm and not s.attention_bias
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (128, 8, 768)
    assert s.norm_topk_prob and not s.router_weights_in_float32
    assert s.sparse_layers == tuple(range(48))
    assert not spec(QWEN3_MOE_CONFIG, norm_topk_prob=False).norm_topk_prob
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    v5 = {k: v for k, v in QWEN3_MOE_CONFIG.items() if k != "num_experts"}
    assert spec(v5, num_local_experts=16).num_experts == 16


def test_qwen2_moe_shared_expert_bias_and_dense_layers() -> None:
    s = spec(QWEN2_MOE_CONFIG)
    assert s.architecture == "qwen2_moe" and s.attention_bias and not s.qk_norm
    assert s.shared_expert_intermediate_size == 5632 and not s.norm_topk_prob
    names = expected_weight_names(s)
    assert "model.layers.3.mlp.shared_expert_gate.weight" in names
    assert "model.layers.3.mlp.experts.59.down_proj.weight" in names
    # decoder_sparse_step 2: layers 1, 3, 5, ... sparse; mlp_only_layers dense whatever the step
    s = spec(QWEN2_MOE_CONFIG, decoder_sparse_step=2, mlp_only_layers=[3])
    assert s.sparse_layers == tuple(i for i in range(1, 24, 2) if i != 3)
    names = expected_weight_names(s)
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.3.mlp.up_proj.weight" in names
    assert "model.layers.3.mlp.gate.weight" not in names
    assert not spec(QWEN2_MOE_CONFIG, qkv_bias=False).attention_bias


def test_model_type_fallback() -> None:
    config = {k: v for k, v in QWEN3_MOE_CONFIG.items() if k != "architectures"}
    assert spec(config).architecture == "qwen3_moe"


@pytest.mark.parametrize("config,changes,match", [
    (MIXTRAL_CONFIG, {"num_local_experts": None}, "num_experts"),
    (MIXTRAL_CONFIG, {"num_experts_per_tok": 9}, "exceeds num_experts"),
    (MIXTRAL_CONFIG, {"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive"),
    (QWEN3_MOE_CONFIG, {"moe_intermediate_size": None}, "moe_intermediate_size"),
    (QWEN3_MOE_CONFIG, {"decoder_sparse_step": -1}, "decoder_sparse_step"),
    (QWEN3_MOE_CONFIG, {"mlp_only_layers": "all"}, "mlp_only_layers"),
    (QWEN2_MOE_CONFIG, {"shared_expert_intermediate_size": 0}, "shared expert"),
])
def test_inconsistent_moe_configs_are_value_errors(config: dict, changes: dict, match: str) -> None:
    if None in changes.values():
        config = {k: v for k, v in config.items() if k not in changes}
        changes = {}
    with pytest.raises(ValueError, match=match):
        spec(config, **changes)


def test_moe_fields_only_on_moe_architectures() -> None:
    s = spec(MIXTRAL_CONFIG)
    with pytest.raises(ValueError, match="Mixture-of-Experts architectures"):
        dataclasses.replace(s, architecture="mistral")
    with pytest.raises(ValueError, match="sparse_layers"):
        dataclasses.replace(s, sparse_layers=(0, 32))
    with pytest.raises(ValueError, match="has no shared expert"):
        dataclasses.replace(s, shared_expert_intermediate_size=128)
