"""The embedded GGUF: our spec and weights against transformers' reading of the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from argosy_runtime.model_loader import Checkpoint, load_checkpoint
from argosy_runtime.model_loader.gguf_checkpoint import undo_rope_permutation
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


def test_alias_resolves_to_embedded_gguf(gguf_path, gguf_checkpoint: Checkpoint) -> None:
    assert gguf_checkpoint.format == "gguf"
    assert gguf_checkpoint.path == gguf_path


def test_spec_matches_transformers_config(gguf_checkpoint: Checkpoint, hf_gguf_model) -> None:
    spec, config = gguf_checkpoint.spec, hf_gguf_model.config
    assert spec.architecture == config.model_type == "llama"
    assert spec.vocab_size == config.vocab_size
    assert spec.hidden_size == config.hidden_size
    assert spec.intermediate_size == config.intermediate_size
    assert spec.num_hidden_layers == config.num_hidden_layers
    assert spec.num_attention_heads == config.num_attention_heads
    assert spec.num_key_value_heads == config.num_key_value_heads
    assert spec.head_dim == config.head_dim
    assert spec.rms_norm_eps == pytest.approx(config.rms_norm_eps, rel=1e-7)
    assert spec.rope_theta == config.rope_parameters["rope_theta"]
    assert config.rope_parameters["rope_type"] == "default" and spec.rope_scaling is None
    assert spec.max_position_embeddings == config.max_position_embeddings
    assert spec.tie_word_embeddings is config.tie_word_embeddings is True
    assert spec.attention_bias is config.attention_bias is False
    assert spec.bos_token_id == config.bos_token_id
    assert spec.eos_token_ids == (config.eos_token_id,)
    assert spec.checkpoint_dtype == "float32"


def test_weights_equal_transformers_state_dict(gguf_checkpoint: Checkpoint, hf_gguf_model) -> None:
    reference = hf_gguf_model.state_dict()
    ours = dict(gguf_checkpoint.iter_weights())
    # Tied: transformers lists lm_head.weight (the same tensor as embed_tokens); we omit it.
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name]), name


def test_rope_permutation_is_undone(gguf_checkpoint: Checkpoint, hf_gguf_model) -> None:
    """Without undoing llama.cpp's permutation q/k differ from transformers (so the test above
    checks the permutation, not just dequantization)."""
    raw = dict(gguf_checkpoint.iter_raw_gguf_tensors())
    name = "model.layers.0.self_attn.q_proj.weight"
    tensor = raw[name]
    permuted = dequantize(tensor.data, tensor.tensor_type).reshape(576, 576)
    reference = hf_gguf_model.state_dict()[name].numpy()
    assert not np.array_equal(permuted, reference)
    assert np.array_equal(undo_rope_permutation(permuted, 9), reference)


def test_raw_tensors_keep_quantization_and_permute_on_blocks(gguf_checkpoint: Checkpoint) -> None:
    raw = dict(gguf_checkpoint.iter_raw_gguf_tensors())
    weights = dict(gguf_checkpoint.iter_weights())
    assert set(raw) == set(weights)
    kinds = {t.tensor_type for t in raw.values()}
    assert GGMLQuantizationType.Q4_1 in kinds and GGMLQuantizationType.Q8_0 in kinds
    # The quantization engineer keeps blocks quantized: undoing the permutation on the raw
    # rows of blocks, then dequantizing, must give the same tensor as iter_weights.
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.q_proj.weight"):
        heads = gguf_checkpoint.gguf_rope_heads(name)
        assert heads == (3 if ".k_proj" in name else 9)
        tensor = raw[name]
        rows = undo_rope_permutation(np.asarray(tensor.data), heads)
        assert np.array_equal(dequantize(rows, tensor.tensor_type), weights[name].numpy())
    assert gguf_checkpoint.gguf_rope_heads("model.layers.3.self_attn.v_proj.weight") is None


def test_raw_tensors_refused_for_hf_checkpoint(random_llama_dir) -> None:
    ckpt = load_checkpoint(str(random_llama_dir))
    with pytest.raises(ValueError, match="GGUF"):
        next(ckpt.iter_raw_gguf_tensors())
