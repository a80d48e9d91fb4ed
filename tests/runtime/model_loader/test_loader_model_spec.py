"""ModelSpec parsing from HF configs (both transformers layouts) and GGUF rope metadata."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from argosy_runtime.model_loader import ModelSpec
from argosy_runtime.model_loader.gguf_checkpoint import _llama3_scaling_from_factors

# Llama-3.2-1B's config.json as published (transformers 4.x layout).
LLAMA32_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama3_config_v4_layout() -> None:
    spec = ModelSpec.from_hf_config(
        LLAMA32_CONFIG,
        checkpoint_dtype="bfloat16",
        generation_config={"eos_token_id": [128001, 128008, 128009]},
    )
    assert spec.architecture == "llama"
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == LLAMA32_CONFIG["rope_scaling"]
    assert spec.eos_token_ids == (128001, 128008, 128009)
    assert spec.num_queries_per_kv == 4
    assert spec.tie_word_embeddings and not spec.attention_bias


def test_v5_rope_parameters_layout() -> None:
    config = {k: v for k, v in LLAMA32_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    config["rope_parameters"] = {**LLAMA32_CONFIG["rope_scaling"], "rope_theta": 500000.0}
    spec = ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16")
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == LLAMA32_CONFIG["rope_scaling"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    assert ModelSpec.from_hf_config(config, checkpoint_dtype="float32").rope_scaling is None


def test_legacy_rope_scaling_type_key_and_defaults() -> None:
    config = {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    spec = ModelSpec.from_hf_config(config, checkpoint_dtype="float16")
    assert spec.architecture == "mistral"
    assert spec.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert spec.head_dim == 16  # hidden / heads when head_dim is absent
    assert spec.num_key_value_heads == 8  # MHA when absent
    assert spec.rope_theta == 10000.0
    assert spec.eos_token_ids == () and spec.bos_token_id is None


def test_qwen2_always_has_qkv_bias() -> None:
    config = {**LLAMA32_CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    del config["attention_bias"]
    assert ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16").attention_bias


def test_model_type_fallback_and_unknown() -> None:
    config = {k: v for k, v in LLAMA32_CONFIG.items() if k != "architectures"}
    assert ModelSpec.from_hf_config(config, checkpoint_dtype="float32").architecture == "llama"
    with pytest.raises(ValueError, match="PhiForCausalLM"):
        ModelSpec.from_hf_config({**LLAMA32_CONFIG, "architectures": ["PhiForCausalLM"]}, checkpoint_dtype="float32")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_key_value_heads", 5, "multiple of num_key_value_heads"),
        ("checkpoint_dtype", "int8", "checkpoint_dtype"),
        ("hidden_size", 0, "hidden_size"),
        ("rope_theta", -1.0, "rope_theta"),
        ("architecture", "gpt2", "gpt2"),
    ],
)
def test_validation_names_the_field(field: str, value, match: str) -> None:
    spec = ModelSpec.from_hf_config(LLAMA32_CONFIG, checkpoint_dtype="bfloat16")
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(spec, **{field: value})


def test_unsupported_features_rejected() -> None:
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelSpec.from_hf_config({**LLAMA32_CONFIG, "mlp_bias": True}, checkpoint_dtype="float32")
    with pytest.raises(ValueError, match="hidden_act"):
        ModelSpec.from_hf_config({**LLAMA32_CONFIG, "hidden_act": "gelu"}, checkpoint_dtype="float32")


def test_llama3_scaling_recovered_from_gguf_rope_freqs() -> None:
    """llama.cpp stores llama3 rope scaling as per-frequency divisors; we recover the HF dict.
    The divisors are computed here from transformers' own llama3 rope implementation."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = copy.deepcopy(LLAMA32_CONFIG)  # LlamaConfig edits rope_scaling in place
    config = LlamaConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim, theta = 64, 500000.0
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    factors = (plain / scaled.double()).float().double()  # GGUF stores float32
    recovered = _llama3_scaling_from_factors(factors, head_dim, theta)
    assert recovered == LLAMA32_CONFIG["rope_scaling"]
    with pytest.raises(ValueError, match="llama3"):
        _llama3_scaling_from_factors(factors * 1.5, head_dim, theta)


# LLAMA32_CONFIG has 16 layers: the expected windows per layer, () when none slides.
@pytest.mark.parametrize(
    ("architecture", "extra", "windows"),
    [
        # Mistral-7B v0.1 windows every layer; v0.2 on publish sliding_window: null.
        ("MistralForCausalLM", {"sliding_window": 4096}, (4096,) * 16),
        ("MistralForCausalLM", {"sliding_window": None}, ()),
        # MistralModel ignores layer_types: every layer still slides.
        ("MistralForCausalLM", {"sliding_window": 64, "layer_types": ["full_attention"] * 16}, (64,) * 16),
        # Qwen2.5 configs carry a sliding_window but use_sliding_window false: no window.
        ("Qwen2ForCausalLM", {"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 8}, ()),
        # Windowing starts at layer max_window_layers.
        ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 8},
         (None,) * 8 + (4096,) * 8),
        ("Qwen3ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 16}, ()),
        ("Qwen3ForCausalLM", {"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 15},
         (None,) * 15 + (512,)),
        # transformers 5 spells it per layer, and still needs use_sliding_window (without it
        # Qwen2Config drops the window and no layer slides).
        ("Qwen2ForCausalLM", {"sliding_window": 1024, "use_sliding_window": True,
                              "layer_types": ["sliding_attention", "full_attention"] * 8},
         (1024, None) * 8),
        ("Qwen2ForCausalLM", {"sliding_window": 1024, "layer_types": ["full_attention"] * 15 + ["sliding_attention"]}, ()),
        ("Qwen2ForCausalLM", {"sliding_window": 1024, "use_sliding_window": True,
                              "layer_types": ["full_attention"] * 16}, ()),
        ("LlamaForCausalLM", {"sliding_window": 4096}, ()),
    ],
)
def test_sliding_windows_per_layer(architecture: str, extra: dict, windows: tuple) -> None:
    config = {**LLAMA32_CONFIG, "architectures": [architecture], "rope_scaling": None, **extra}
    spec = ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16")
    assert spec.layer_sliding_windows == windows
    assert [spec.sliding_window(i) for i in range(16)] == list(windows or (None,) * 16)
    # Windowed attention runs past the window: the trained context is the limit.
    assert spec.max_position_embeddings == 131072


def test_sliding_windows_follow_transformers_layer_types() -> None:
    """The per-layer windows are the ones transformers' own config derives."""
    from transformers import Qwen2Config

    hf = Qwen2Config(num_hidden_layers=6, sliding_window=8, use_sliding_window=True, max_window_layers=4)
    config = {**LLAMA32_CONFIG, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None,
              "num_hidden_layers": 6, "sliding_window": 8, "use_sliding_window": True,
              "max_window_layers": 4}
    spec = ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16")
    assert [8 if t == "sliding_attention" else None for t in hf.layer_types] == list(spec.layer_sliding_windows)


def test_sliding_window_must_be_positive() -> None:
    spec = ModelSpec.from_hf_config(LLAMA32_CONFIG, checkpoint_dtype="bfloat16")
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        dataclasses.replace(spec, layer_sliding_windows=(None,) * 15 + (0,))
    with pytest.raises(ValueError, match="one entry per layer"):
        dataclasses.replace(spec, layer_sliding_windows=(8,))
