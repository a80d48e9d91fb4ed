"""Gemma 3 config.json -> ModelSpec: transformers' defaults for omitted fields, the nested
text_config of Gemma3ForConditionalGeneration, both rope layouts (4.x rope_theta /
rope_local_base_freq / rope_scaling; 5.x rope_parameters per layer type), layer_types or
sliding_window_pattern, and clear errors for what is not served."""

from __future__ import annotations

import pytest
from argosy_runtime.model_loader.gemma3_config import GEMMA3_TEXT_DEFAULTS
from argosy_runtime.model_loader.model_spec import ModelSpec


def spec(config: dict) -> ModelSpec:
    return ModelSpec.from_hf_config(config, checkpoint_dtype="bfloat16")


def test_defaults_are_transformers_gemma3_text_config() -> None:
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig()
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        assert getattr(hf, key) == value, key
    s = spec({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"})
    assert s.architecture == "gemma3" and s.hidden_act == "gelu_pytorch_tanh"
    assert (s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (2304, 8, 4, 256)
    assert s.tie_word_embeddings and s.qk_norm and s.gemma_norms
    assert s.attention_scale == 256 ** -0.5 and s.embedding_scale == 2304 ** 0.5
    # sliding_window_pattern 6: every sixth layer is full attention, rotated with rope_theta.
    expected = tuple(None if (i + 1) % 6 == 0 else 4096 for i in range(26))
    assert s.layer_sliding_windows == expected
    assert (s.rope_theta, s.rope_scaling, s.local_rope_theta) == (1e6, None, 1e4)
    assert [s.local_rope(i) for i in range(6)] == [True] * 5 + [False]
    assert s.final_logit_softcapping is None


def test_hub_1b_config_4x_layout() -> None:
    """gemma-3-1b-it's config.json (transformers 4.50): rope_theta, rope_local_base_freq,
    rope_scaling null, sliding_window_pattern."""
    s = spec({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "bos_token_id": 2,
        "eos_token_id": [1, 106], "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144,
    })
    assert (s.rope_theta, s.rope_scaling, s.local_rope_theta) == (1e6, None, 1e4)
    assert s.layer_sliding_windows[:6] == (512,) * 5 + (None,) and s.eos_token_ids == (1, 106)
    assert (s.num_key_value_heads, s.head_dim, s.hidden_size) == (1, 256, 1152)


def test_hub_multimodal_config_4x_layout() -> None:
    """gemma-3-4b-it's config.json: the text model nested, most fields left at defaults,
    linear rope scaling for the global layers in the 4.x layout."""
    s = spec({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"},
    })
    assert (s.hidden_size, s.num_hidden_layers, s.vocab_size) == (2560, 34, 262_208)
    assert s.rope_scaling == {"factor": 8.0, "rope_type": "linear"} and s.rope_theta == 1e6
    assert s.local_rope_theta == 1e4 and s.layer_sliding_windows[:6] == (1024,) * 5 + (None,)
    assert s.eos_token_ids == (1, 106) and s.bos_token_id == 2 and s.tie_word_embeddings


def test_transformers_5_rope_parameters_and_layer_types() -> None:
    s = spec({
        "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 3, "hidden_size": 64,
        "num_attention_heads": 4, "head_dim": 32, "query_pre_attn_scalar": 24,
        "sliding_window": 8, "final_logit_softcapping": 30.0,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
    })
    assert s.layer_sliding_windows == (None, 8, None)
    assert [s.local_rope(i) for i in range(3)] == [False, True, False]
    assert s.rope_theta == 5000.0 and s.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert s.local_rope_theta == 100.0 and s.attention_scale == 24 ** -0.5
    assert s.final_logit_softcapping == 30.0


@pytest.mark.parametrize(("change", "match"), [
    ({"attn_logit_softcapping": 50.0}, "transformers' Gemma 3 attention ignores it"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding-window layers"),
])
def test_unsupported_gemma3_configs_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, **change})


def test_softcapping_on_conditional_generation_is_refused() -> None:
    # transformers applies it in Gemma3ForCausalLM only: which one a config means is unclear.
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration ignores it"):
        spec({"architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {"final_logit_softcapping": 30.0}})


def test_attention_softcapping_is_gemma2s() -> None:
    """Gemma 2's configs soft-cap attention (tests/runtime/engine/test_gemma2.py); Gemma 3's
    refuse it (above): transformers' Gemma3Attention never passes it on."""
    assert spec({"architectures": ["Gemma3ForCausalLM"]}).attn_logit_softcapping is None
    assert spec({"architectures": ["Gemma2ForCausalLM"], "hidden_size": 64,
                 "num_attention_heads": 4}).attn_logit_softcapping == 50.0


def _gemma3_gguf_spec(tmp_path, layers: int, **extra) -> ModelSpec:  # noqa: ANN001
    from argosy_runtime.model_loader.gguf_checkpoint import spec_from_gguf
    from argosy_runtime.model_loader.gguf_metadata import open_gguf
    from model_factory import write_tiny_gguf

    path = tmp_path / f"gemma3-{layers}-{len(extra)}.gguf"

    def gemma3(writer) -> None:  # noqa: ANN001
        writer.add_key_length(16)
        writer.add_sliding_window(8)
        if "pattern" in extra:
            writer.add_sliding_window_pattern(extra["pattern"])
        if "local_theta" in extra:
            writer.add_float32("gemma3.rope.freq_base_swa", extra["local_theta"])

    write_tiny_gguf(path, "gemma3", context=128, hidden=64, layers=layers, ffn=32, eps=1e-6,
                    tokenizer_model=None, extra=gemma3)
    return spec_from_gguf(open_gguf(path))


def test_gemma3_gguf_takes_llama_cpps_fixed_values(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's gemma3 files say neither the layer pattern, nor the sliding layers' rotary
    base, nor query_pre_attn_scalar: its graph's values (every 6th layer full, 10000,
    head_dim; (hidden / heads) for the 62-layer 27B) unless a file has the keys."""
    s = _gemma3_gguf_spec(tmp_path, 7)
    assert s.architecture == "gemma3" and s.hidden_act == "gelu_pytorch_tanh" and s.qk_norm
    assert s.layer_sliding_windows == (8, 8, 8, 8, 8, None, 8)
    assert (s.local_rope_theta, s.query_pre_attn_scalar, s.final_logit_softcapping) == (
        10000.0, 16.0, None)
    assert _gemma3_gguf_spec(tmp_path, 62).query_pre_attn_scalar == 32.0  # 64 / 2 heads
    s = _gemma3_gguf_spec(tmp_path, 3, pattern=[True, False, True], local_theta=100.0)
    assert s.layer_sliding_windows == (8, None, 8) and s.local_rope_theta == 100.0
