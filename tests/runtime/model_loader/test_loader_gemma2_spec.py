"""Gemma 2 config.json -> ModelSpec: transformers' Gemma2Config defaults for omitted fields
(soft caps 50 / 30, every other layer sliding), the Hub's 4.x configs, one rotary table, and
clear errors for what is not served; llama.cpp gemma2 GGUF metadata."""

from __future__ import annotations

import pytest
from argosy_runtime.model_loader.gemma3_config import GEMMA2_DEFAULTS
from argosy_runtime.model_loader.model_spec import ModelSpec


def spec(config: dict) -> ModelSpec:
    return ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16")


def test_defaults_are_transformers_gemma2_config() -> None:
    from transformers import Gemma2Config

    hf = Gemma2Config()
    for key, value in GEMMA2_DEFAULTS.items():
        assert getattr(hf, key) == value, key
    s = spec({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    assert s.architecture == "gemma2" and s.hidden_act == "gelu_pytorch_tanh"
    assert (s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (2304, 8, 4, 256)
    assert s.tie_word_embeddings and s.gemma_norms and s.is_gemma and not s.qk_norm
    assert s.attention_scale == 256 ** -0.5 and s.embedding_scale == 2304 ** 0.5
    assert (s.attn_logit_softcapping, s.final_logit_softcapping) == (50.0, 30.0)
    # Gemma2Config's layer_types: layer i slides when (i + 1) % 2, i.e. the even layers.
    assert list(hf.layer_types[:4]) == ["sliding_attention", "full_attention"] * 2
    assert s.layer_sliding_windows == tuple(4096 if i % 2 == 0 else None for i in range(26))
    assert (s.rope_theta, s.rope_scaling, s.local_rope_theta) == (10000.0, None, None)
    assert not any(s.local_rope(i) for i in range(26))
    assert spec({"model_type": "gemma2"}).architecture == "gemma2"  # no `architectures`


def test_hub_27b_config_4x_layout() -> None:
    """gemma-2-27b-it's config.json (transformers 4.42): both activation keys, the soft caps,
    query_pre_attn_scalar 144 (hidden / heads, not head_dim), no layer_types."""
    s = spec({
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 128,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 4608, "intermediate_size": 36864, "max_position_embeddings": 8192,
        "model_type": "gemma2", "num_attention_heads": 32, "num_hidden_layers": 46,
        "num_key_value_heads": 16, "pad_token_id": 0, "query_pre_attn_scalar": 144,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "vocab_size": 256000,
    })
    assert s.attention_scale == 144 ** -0.5 and s.head_dim == 128
    assert s.layer_sliding_windows[:3] == (4096, None, 4096) and len(s.layer_sliding_windows) == 46
    assert s.eos_token_ids == (1, 107) and s.bos_token_id == 2
    assert (s.attn_logit_softcapping, s.final_logit_softcapping) == (50.0, 30.0)


def test_transformers_5_layout_and_explicit_values() -> None:
    s = spec({"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 3,
              "layer_types": ["full_attention", "sliding_attention", "full_attention"],
              "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
              "sliding_window": 8, "attn_logit_softcapping": None,
              "final_logit_softcapping": None})
    assert s.layer_sliding_windows == (None, 8, None) and s.rope_theta == 5000.0
    assert (s.attn_logit_softcapping, s.final_logit_softcapping) == (None, None)


@pytest.mark.parametrize(("change", "match"), [
    ({"attn_logit_softcapping": 0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "Gemma 2 hidden_activation 'gelu'"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window is not set"),
])
def test_unsupported_gemma2_configs_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec({"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 2, **change})


def test_softcapping_is_a_gemma_field() -> None:
    import dataclasses

    llama = spec({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                  "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
                  "vocab_size": 10})
    with pytest.raises(ValueError, match="Gemma fields"):
        dataclasses.replace(llama, attn_logit_softcapping=50.0)


def _gemma2_gguf_spec(tmp_path, layers: int, **extra) -> ModelSpec:  # noqa: ANN001
    from argosy_runtime.model_loader.gguf_checkpoint import spec_from_gguf
    from argosy_runtime.model_loader.gguf_metadata import open_gguf
    from model_factory import write_tiny_gguf

    path = tmp_path / f"gemma2-{layers}-{len(extra)}.gguf"

    def gemma2(writer) -> None:  # noqa: ANN001
        writer.add_key_length(16)
        if "window" in extra:
            writer.add_sliding_window(extra["window"])
        if "caps" in extra:
            writer.add_attn_logit_softcapping(extra["caps"][0])
            writer.add_final_logit_softcapping(extra["caps"][1])

    write_tiny_gguf(path, "gemma2", context=128, hidden=64, layers=layers, ffn=32, eps=1e-6,
                    tokenizer_model=None, extra=gemma2)
    return spec_from_gguf(open_gguf(path))


def test_gemma2_gguf_takes_llama_cpps_fixed_values(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's gemma2 files say neither the layer pattern nor query_pre_attn_scalar: its
    graph's values (the even layers slide; head_dim, or hidden / heads for the 46-layer 27B),
    its defaults for a missing window (4096) and soft caps (50 / 30)."""
    s = _gemma2_gguf_spec(tmp_path, 3)
    assert s.architecture == "gemma2" and s.hidden_act == "gelu_pytorch_tanh" and not s.qk_norm
    assert s.layer_sliding_windows == (4096, None, 4096)
    assert (s.query_pre_attn_scalar, s.attn_logit_softcapping, s.final_logit_softcapping,
            s.local_rope_theta) == (16.0, 50.0, 30.0, None)
    assert _gemma2_gguf_spec(tmp_path, 46).query_pre_attn_scalar == 32.0  # 64 / 2 heads
    s = _gemma2_gguf_spec(tmp_path, 2, window=8, caps=(20.0, 10.0))
    assert s.layer_sliding_windows == (8, None)
    assert (s.attn_logit_softcapping, s.final_logit_softcapping) == (20.0, 10.0)
