"""Phi-3 family configs (Phi-3-mini-4k/128k, Phi-3.5-mini, Phi-4, Phi-4-mini) -> ModelSpec, in
the transformers 4.x layout the Hub files use and the 5.x one transformers writes; longrope
frequencies and scale equal to transformers'; the fused qkv / gate_up tensors split in the
right order; clear errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from argosy_runtime.model_loader import ModelSpec, load_checkpoint
from argosy_runtime.model_loader.hf_checkpoint import split_phi3_fused
from argosy_runtime.models.rotary import rope_inv_freq
from model_factory import write_tiny_gguf

# microsoft/Phi-3-mini-4k-instruct's config.json (and generation_config.json's eos list).
PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32064,
}
PHI3_GENERATION = {"bos_token_id": 1, "eos_token_id": [32000, 32001, 32007], "pad_token_id": 32000}
# Phi-3-mini-128k / Phi-3.5-mini: longrope over head_dim 96 (48 factors per list).
PHI3_MINI_128K = {
    **PHI3_MINI_4K, "max_position_embeddings": 131072, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(48)],
                     "long_factor": [1.0 + 0.5 * i for i in range(48)]},
}
# Phi-4-mini-instruct: GQA 24/8, head_dim 128 of which 96 rotated (partial_rotary_factor 0.75).
PHI4_MINI = {
    **PHI3_MINI_128K, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
    "intermediate_size": 8192, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
    "vocab_size": 200064, "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
}
# Phi-4 (14B): plain rotary, no window.
PHI4 = {
    **PHI3_MINI_4K, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 10,
    "intermediate_size": 17920, "max_position_embeddings": 16384,
    "original_max_position_embeddings": 16384, "rope_theta": 250000, "sliding_window": None,
    "vocab_size": 100352, "eos_token_id": 100265, "bos_token_id": 100257, "pad_token_id": 100349,
}


def spec_of(config: dict, **kwargs) -> ModelSpec:
    return ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16", **kwargs)


def test_phi3_mini_4k_windows_every_layer_and_stops_on_end() -> None:
    spec = spec_of(PHI3_MINI_4K, generation_config=PHI3_GENERATION)
    assert spec.architecture == "phi3" and spec.rope_scaling is None
    assert spec.head_dim == spec.rotary_dim == 96 and not spec.attention_bias
    assert spec.layer_sliding_windows == (2047,) * 32  # transformers windows every layer
    assert spec.eos_token_ids == (32000, 32001, 32007)  # <|end|> 32007 from generation_config


@pytest.mark.parametrize("rope_type", ["longrope", "su"])
def test_phi3_128k_longrope(rope_type: str) -> None:
    config = {**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "type": rope_type}}
    spec = spec_of(config)
    scaling = spec.rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096
    assert scaling["attention_factor"] == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    assert spec.layer_sliding_windows == ()  # 262144 > 131072 positions: never binds


def test_phi4_mini_partial_rotary_and_phi4() -> None:
    spec = spec_of(PHI4_MINI)
    assert spec.head_dim == 128 and spec.rotary_dim == 96 and spec.partial_rotary_factor == 0.75
    assert spec.tie_word_embeddings and spec.num_queries_per_kv == 3
    assert "partial_rotary_factor" not in spec.rope_scaling
    phi4 = spec_of(PHI4)
    assert phi4.rope_scaling is None and phi4.rope_theta == 250000.0
    assert phi4.layer_sliding_windows == () and phi4.rotary_dim == 128


@pytest.mark.parametrize("config", [PHI3_MINI_4K, PHI3_MINI_128K, PHI4_MINI, PHI4],
                         ids=["mini-4k", "mini-128k", "phi4-mini", "phi4"])
def test_transformers_5_layout_gives_the_same_spec(config: dict) -> None:
    """Phi3Config reads the 4.x file; its to_dict() is the 5.x layout (`rope_parameters`
    holding rope_theta, partial_rotary_factor and original_max_position_embeddings)."""
    from transformers import Phi3Config

    v5 = Phi3Config.from_dict(copy.deepcopy(config)).to_dict()
    assert "rope_parameters" in v5
    assert spec_of(v5) == spec_of(config)


@pytest.mark.parametrize("max_positions", [4096, 4097, 131072])
def test_longrope_frequencies_and_scale_equal_transformers(max_positions: int) -> None:
    """Short factors up to original_max_position_embeddings, long ones past it (transformers
    picks by the forward's length; we by the served length), partial rotary's width."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = spec_of(PHI4_MINI)
    hf = Phi3Config.from_dict(copy.deepcopy(PHI4_MINI))  # it edits nested dicts
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=max_positions)
    got, scale = rope_inv_freq(spec.rotary_dim, spec.rope_theta, spec.rope_scaling, max_positions)
    assert torch.equal(got, want) and scale == want_scale


def test_invalid_phi3_rope_configs() -> None:
    short = {**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 64}}
    with pytest.raises(ValueError, match="short_factor must be a list of 48 numbers"):
        spec_of(short)
    with pytest.raises(ValueError, match="Phi-3 rope scaling type 'linear'"):
        spec_of({**PHI3_MINI_4K, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        spec_of({**PHI4, "partial_rotary_factor": 0.01})


def test_fused_qkv_and_gate_up_split_in_transformers_order() -> None:
    spec = spec_of({**PHI4_MINI, "hidden_size": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 6, "num_hidden_layers": 1,
                    "partial_rotary_factor": 1.0, "rope_scaling": None})  # head_dim 2
    qkv = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)  # q 8 rows, k 4, v 4
    parts = dict(split_phi3_fused("model.layers.0.self_attn.qkv_proj.weight", qkv, spec))
    assert torch.equal(parts["model.layers.0.self_attn.q_proj.weight"], qkv[:8])
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], qkv[8:12])
    assert torch.equal(parts["model.layers.0.self_attn.v_proj.weight"], qkv[12:])
    gate_up = torch.randn(12, 8)
    parts = dict(split_phi3_fused("model.layers.0.mlp.gate_up_proj.weight", gate_up, spec))
    assert torch.equal(parts["model.layers.0.mlp.gate_proj.weight"], gate_up[:6])
    assert torch.equal(parts["model.layers.0.mlp.up_proj.weight"], gate_up[6:])
    assert split_phi3_fused("model.layers.0.self_attn.o_proj.weight", qkv, spec) is None
    with pytest.raises(ValueError, match="shape mismatch"):
        split_phi3_fused("model.layers.0.self_attn.qkv_proj.weight", qkv[:15], spec)


def _phi3_gguf(path, window: int, rope_dims: int):  # noqa: ANN001, ANN202
    """A phi3 file's metadata as Phi3MiniModel.set_gguf_parameters writes it (no key_length;
    rope.dimension_count = rotary dims; sliding_window 0 for none)."""

    def phi3(writer) -> None:  # noqa: ANN001
        writer.add_rope_scaling_orig_ctx_len(4096)
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_freq_base(10000.0)
        writer.add_sliding_window(window)

    return write_tiny_gguf(path, "phi3", context=4096, hidden=64, layers=2, ffn=128, heads=4,
                           kv_heads=2, extra=phi3)


def test_gguf_phi3_spec(tmp_path) -> None:  # noqa: ANN001
    # Phi-3-mini-4k: every layer windowed (2047 < 4096), full rotary, no longrope tensors.
    spec = load_checkpoint(str(_phi3_gguf(tmp_path / "mini.gguf", 2047, 16))).spec
    assert spec.architecture == "phi3" and spec.head_dim == 16 and spec.rotary_dim == 16
    assert spec.layer_sliding_windows == (2047, 2047) and spec.rope_scaling is None
    # Phi-4-mini style: sliding_window 0 (none), 12 of 16 dims rotated.
    spec = load_checkpoint(str(_phi3_gguf(tmp_path / "phi4.gguf", 0, 12))).spec
    assert spec.layer_sliding_windows == () and spec.partial_rotary_factor == 0.75
