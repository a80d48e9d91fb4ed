"""config.json read as transformers 5's config classes read it: a field a config omits takes
its class's default (Mixtral's rope base 1e6 and eps 1e-5, Phi-3's eps 1e-5, Mistral's window
4096, Qwen3's head_dim 128, the Qwen families' max_window_layers 28), and a `rope_scaling`
next to `rope_parameters` (a 5.x config a user added it to) is the one that applies.
Every expectation is transformers' own config object for the same dict."""

from __future__ import annotations

import copy

import pytest
import transformers
from argosy_runtime.model_loader import ModelSpec

# 32 heads: the defaults' KV head counts (4, 8, 16, 32) divide it. 30 layers: past the Qwen
# families' default max_window_layers (28).
SHAPE = dict(vocab_size=128, hidden_size=256, intermediate_size=128, num_hidden_layers=30,
             num_attention_heads=32)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}
EXPERTS = {  # required by the engine (no guessing of expert shapes)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}
# transformers windows every layer of these when the config has a window; the others per
# layer_types.
ALL_LAYERS_WINDOWED = ("mistral", "mixtral", "phi3", "qwen3_moe")


def hf_and_ours(model_type: str, **fields) -> tuple[transformers.PreTrainedConfig, ModelSpec]:  # noqa: ANN003
    config = {**SHAPE, **EXPERTS.get(model_type, {}), **fields}
    # (transformers fills the rope dicts it is given in place: a copy each)
    hf = transformers.AutoConfig.for_model(model_type, **copy.deepcopy(config))
    ours = ModelSpec.from_hf_config(
        {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **config},
        checkpoint_dtype="float32")
    return hf, ours


def hf_windows(hf: transformers.PreTrainedConfig, model_type: str) -> list[int | None]:
    window = getattr(hf, "sliding_window", None) or None
    if model_type == "llama" or window is None:
        return [None] * hf.num_hidden_layers
    if model_type in ALL_LAYERS_WINDOWED:
        return [window] * hf.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in hf.layer_types]


@pytest.mark.parametrize("use_sliding_window", [False, True])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_omitted_fields_take_the_config_class_defaults(model_type: str,
                                                        use_sliding_window: bool) -> None:
    fields = {"use_sliding_window": True} if use_sliding_window else {}
    hf, ours = hf_and_ours(model_type, **fields)
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None)
                             or hf.hidden_size // hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    windows = list(ours.layer_sliding_windows) or [None] * ours.num_hidden_layers
    assert windows == hf_windows(hf, model_type)


LINEAR = {"rope_type": "linear", "factor": 4.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("model_type,fields", [
    # rope_scaling wins; its base is the top-level rope_theta, else the class default
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                   rope_scaling=LINEAR)),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                   rope_scaling=LINEAR, rope_theta=3000.0)),
    ("mixtral", dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                     rope_scaling=LINEAR)),
    ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                   rope_scaling={"type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64})),
    # a null rope_scaling leaves rope_parameters alone
    ("llama", dict(rope_parameters={**LINEAR, "rope_theta": 5000.0}, rope_scaling=None)),
    # llama3 without original_max_position_embeddings: max_position_embeddings
    ("llama", dict(rope_parameters={**LLAMA3, "rope_theta": 5e5}, max_position_embeddings=256)),
])
def test_rope_scaling_and_rope_parameters_as_transformers(model_type: str, fields: dict) -> None:
    hf, ours = hf_and_ours(model_type, **fields)
    expected = dict(hf.rope_parameters)
    assert ours.rope_theta == expected.pop("rope_theta")
    got = ours.rope_scaling or {"rope_type": "default"}
    assert {k: got.get(k) for k in expected if k != "type"} == {
        k: v for k, v in expected.items() if k != "type"}


def test_gemma3_rope_scaling_updates_the_full_attention_layers() -> None:
    # gemma-3-4b and up scale their full-attention layers (linear x8); a 5.x config carries
    # the per-layer-type rope_parameters, to which a user may add the 4.x rope_scaling.
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 1e4}},
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    hf = transformers.Gemma3TextConfig(**copy.deepcopy(config))
    ours = ModelSpec.from_hf_config({"architectures": ["Gemma3ForCausalLM"],
                                     "model_type": "gemma3_text", **config},
                                    checkpoint_dtype="float32")
    full = dict(hf.rope_parameters["full_attention"])
    assert (full["rope_type"], full["factor"]) == ("linear", 8.0)
    assert ours.rope_theta == full["rope_theta"]
    assert ours.rope_scaling["rope_type"] == "linear" and ours.rope_scaling["factor"] == 8.0
    assert ours.local_rope_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
