"""Gemma 2 and Gemma 3 `config.json` -> the flat fields `ModelSpec.from_hf_config` reads.

Gemma 3 differs from the Llama family's config in ways the generic parser cannot guess:
- `Gemma3ForConditionalGeneration` (gemma-3-4b/12b/27b-it) nests the decoder's fields in
  `text_config`; only the text model is served.
- Hub configs omit the fields that sit at `Gemma3TextConfig`'s defaults (gemma-3-4b-it's
  `text_config` lists six), so those defaults (transformers 5.25) fill the gaps.
- Two rotary tables: full-attention layers use `rope_theta` with `rope_scaling` (linear x8 on
  4b and up), sliding-window layers `rope_local_base_freq`, unscaled. transformers 5 writes
  them as `rope_parameters` keyed by layer type.
- Sliding layers per `layer_types`, else every `sliding_window_pattern`-th layer (default 6)
  is full attention.
Gemma 2 (`Gemma2ForCausalLM`) is the same minus the nesting and the second rotary table (one
`rope_theta` for all layers, read by the generic parser), with its own defaults
(`Gemma2Config`'s: attention logit soft-capping 50, final 30) and every other layer sliding
(layer i slides when i is even: `(i + 1) % 2`, pattern 2). Its attention scores are
soft-capped (`attn_logit_softcapping`) on every attention path; a Gemma 3 config that sets
the field is refused, as transformers' Gemma 3 stores it but never applies it.
"""

from __future__ import annotations

from typing import Any

from argosy_runtime.model_loader.model_spec import config_float, config_int

# transformers' Gemma3TextConfig defaults (checked against it in
# tests/runtime/model_loader/test_loader_gemma3_spec.py).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "eos_token_id": 1,
    "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
# transformers' Gemma2Config defaults (checked against it in
# tests/runtime/model_loader/test_loader_gemma2_spec.py).
GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "eos_token_id": 1,
    "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None,
}
_GLOBAL_THETA, _LOCAL_THETA, _PATTERN = 1_000_000.0, 10_000.0, 6
_GEMMA2_PATTERN = 2  # Gemma2Config: layer i slides when (i + 1) % 2, the even layers
_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_text_config(config: dict[str, Any], architecture: str = "gemma3"
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the decoder's config in the generic layout, the Gemma-only ModelSpec fields), for
    `architecture` "gemma3" or "gemma2".

    The first has every field filled in, `layer_types` per layer and (Gemma 3)
    `rope_parameters` flat (the full-attention layers' theta and scaling); the second holds
    `hidden_act`, `query_pre_attn_scalar`, `local_rope_theta` (Gemma 3),
    `final_logit_softcapping` and `attn_logit_softcapping`. Raises ValueError for what is not
    served: bidirectional attention, another activation, scaled rotary on Gemma 3's sliding
    layers, a soft cap that is not a positive number, attention soft-capping on Gemma 3.
    """
    gemma2 = architecture == "gemma2"
    nested = None if gemma2 else config.get("text_config")
    text = dict(nested) if isinstance(nested, dict) else dict(config)
    merged = {**(GEMMA2_DEFAULTS if gemma2 else GEMMA3_TEXT_DEFAULTS), **text}
    if isinstance(nested, dict):  # the multimodal wrapper: its own ids and tying count too
        eos = _ids(text.get("eos_token_id", GEMMA3_TEXT_DEFAULTS["eos_token_id"]))
        merged["eos_token_id"] = eos + _ids(config.get("eos_token_id"))
        for key in ("bos_token_id", "tie_word_embeddings"):
            if key not in text and config.get(key) is not None:
                merged[key] = config[key]
    name = "Gemma 2" if gemma2 else "Gemma 3"
    if merged.get("use_bidirectional_attention"):
        raise ValueError(f"config.json: use_bidirectional_attention=true (an encoder-style "
                         f"{name}, e.g. EmbeddingGemma) is not supported: causal attention only")
    act = merged.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: {name} hidden_activation {act!r} is not supported "
                         "(gelu_pytorch_tanh only)")
    merged.pop("hidden_act", None)  # Gemma reads hidden_activation; a stray hidden_act is unused
    cap = _soft_cap(merged, "final_logit_softcapping")
    attn_cap = _soft_cap(merged, "attn_logit_softcapping")
    if attn_cap is not None and not gemma2:
        raise ValueError("config.json: attn_logit_softcapping in a Gemma 3 config is not "
                         "supported: transformers' Gemma 3 attention ignores it where its "
                         "Gemma 2 applies it, so what a checkpoint means is unclear (Gemma 3 "
                         "checkpoints leave it null)")
    if cap is not None and isinstance(nested, dict):
        raise ValueError("config.json: final_logit_softcapping in a Gemma3ForConditionalGeneration "
                         "text_config is not supported: transformers' Gemma3ForConditionalGeneration "
                         "ignores it where Gemma3ForCausalLM applies it (Gemma 3 checkpoints "
                         "leave it null)")

    num_layers = config_int(merged, "num_hidden_layers")
    layer_types = merged.get("layer_types")
    if layer_types is None and gemma2:
        layer_types = ["sliding_attention" if (i + 1) % _GEMMA2_PATTERN else "full_attention"
                       for i in range(num_layers)]
    elif layer_types is None:
        pattern = int(merged.get("sliding_window_pattern") or merged.get("_sliding_window_pattern")
                      or _PATTERN)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or any(t not in _LAYER_TYPES for t in layer_types)):
        raise ValueError(f"config.json: layer_types must list {num_layers} entries of "
                         f"{' / '.join(_LAYER_TYPES)}, got {layer_types!r}")
    if "sliding_attention" in layer_types and not merged.get("sliding_window"):
        raise ValueError("config.json: layer_types has sliding_attention layers but "
                         "sliding_window is not set")
    merged["layer_types"] = layer_types
    gemma = {
        "hidden_act": act,
        "query_pre_attn_scalar": config_float(merged, "query_pre_attn_scalar", None),
        "final_logit_softcapping": cap,
        "attn_logit_softcapping": attn_cap,
    }
    if gemma2:  # one rotary table: rope_theta / rope_scaling / rope_parameters as Llama's
        return merged, gemma

    full, local = _rope_by_layer_type(merged)
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"config.json: rope scaling {local_type!r} on the sliding-window "
                         "layers is not supported (Gemma 3 scales the full-attention layers only)")
    # transformers' yarn reads `truncate` from the top of the rope_parameters, which Gemma 3
    # always keys by layer type: its yarn truncates whatever the full-attention dict says.
    full.pop("truncate", None)
    merged["rope_parameters"] = full
    for key in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
        merged.pop(key, None)
    gemma["local_rope_theta"] = float(local["rope_theta"])
    return merged, gemma


def _soft_cap(config: dict[str, Any], key: str) -> float | None:
    """config[key] as a float, None when null; ValueError unless a positive number."""
    cap = config.get(key)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or cap <= 0):
        raise ValueError(f"config.json: {key} must be a positive number or null, got {cap!r}")
    return None if cap is None else float(cap)


def _rope_by_layer_type(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention rope dict, sliding-window rope dict), each with `rope_theta`, as
    Gemma3TextConfig.convert_rope_params_to_dict builds them from either layout."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(t in params for t in _LAYER_TYPES):  # transformers 5
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # 4.x: rope_theta + rope_scaling (full layers), rope_local_base_freq (sliding)
        full = dict(params) if isinstance(params, dict) else {}
        local = {}
    # In either layout a rope_scaling updates the full-attention layers' dict, as transformers'
    # Gemma3TextConfig does (a 5.x config a user added it to would otherwise run unscaled).
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta") or _GLOBAL_THETA)
    local.setdefault("rope_theta", config.get("rope_local_base_freq") or _LOCAL_THETA)
    return full, local


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
