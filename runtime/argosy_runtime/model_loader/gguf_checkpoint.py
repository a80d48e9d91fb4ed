"""GGUF files: hyperparameters from metadata, tensors renamed to HF names and dequantized.

llama.cpp's converter stores Llama's q_proj/k_proj rows permuted (it interleaves the two
rotary halves of every head, matching ggml's "normal" rope), so we undo that permutation to get
exactly the tensors transformers has. Qwen2 files are not permuted (ggml uses NEOX rope there).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from argosy_runtime.model_loader.gguf_metadata import read_field
from argosy_runtime.model_loader.model_spec import ModelSpec

# general.architecture values we read, and whether their q/k rows are rope-permuted.
_GGUF_ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's Mixture-of-Experts architectures (Mixtral is filed under "llama" with an
# `llama.expert_count`): refused with a clear error, their stacked expert tensors unread.
_GGUF_MOE_ARCHITECTURES = {"qwen2moe": "Qwen2-MoE", "qwen3moe": "Qwen3-MoE",
                           "mixtral": "Mixtral"}
# Tensors that are not weights of the HF model (llama.cpp's precomputed llama3 rope factors).
_NON_WEIGHT_TENSORS = {"rope_freqs.weight"}

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def gguf_to_hf_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor name ("blk.3.attn_q.weight" -> "model.layers.3...")."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in a supported model")


def undo_rope_permutation(weights: ArrayT, num_heads: int) -> ArrayT:
    """Undo llama.cpp's q/k row permutation. `weights`: [num_heads * head_dim, ...].

    llama.cpp wrote rows of each head as (head_dim/2, 2) -> reshaped to (2, head_dim/2); we swap
    back. Works on any array whose first axis is the output rows, including still-quantized
    block data ([rows, bytes_per_row]) since quantization blocks run along a row.
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    if isinstance(w, torch.Tensor):
        return w.transpose(1, 2).reshape(weights.shape)
    return w.swapaxes(2, 1).reshape(weights.shape)


def spec_from_gguf(reader: GGUFReader) -> ModelSpec:
    """The `ModelSpec` of a GGUF file, from its `{arch}.*` metadata and tensor list."""
    gguf_arch = read_field(reader, "general.architecture")
    expert_count = read_field(reader, f"{gguf_arch}.expert_count", 0) or 0
    if gguf_arch in _GGUF_MOE_ARCHITECTURES or int(expert_count) > 0:
        name = _GGUF_MOE_ARCHITECTURES.get(gguf_arch,
                                           "Mixtral" if gguf_arch == "llama" else gguf_arch)
        raise ValueError(
            f"GGUF Mixture-of-Experts files are not supported (general.architecture "
            f"{gguf_arch!r}, {name}, {int(expert_count)} experts); load the model's Hugging "
            "Face folder instead (MixtralForCausalLM, Qwen2MoeForCausalLM and "
            "Qwen3MoeForCausalLM run from safetensors)"
        )
    if gguf_arch not in _GGUF_ARCHITECTURES:
        # llama.cpp's phi3 files (Phi-3, Phi-3.5, Phi-4) store qkv and gate/up fused and the
        # longrope factors as tensors: not read here; the safetensors folder is.
        hint = ("; Phi-3 / Phi-4: load the model's Hugging Face folder instead "
                "(Phi3ForCausalLM runs from safetensors)" if gguf_arch == "phi3" else "")
        raise ValueError(
            f"GGUF general.architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(_GGUF_ARCHITECTURES)}{hint}"
        )
    architecture = gguf_arch
    # llama.cpp files Mistral under "llama"; the name is the only hint (transformers does the same).
    if gguf_arch == "llama" and "mistral" in str(read_field(reader, "general.name", "")).lower():
        architecture = "mistral"

    def meta(key: str, default: Any = ...) -> Any:
        full = f"{gguf_arch}.{key}"
        return read_field(reader, full) if default is ... else read_field(reader, full, default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"GGUF rope.dimension_count {rope_dims} != head_dim {head_dim} (partial rotary) is not supported")
    rope_theta = float(meta("rope.freq_base", 10000.0))
    context_length = int(meta("context_length"))
    rope_scaling = _gguf_rope_scaling(reader, gguf_arch, tensors, head_dim, rope_theta, context_length)
    # The embedding's row count is the vocabulary the model was trained with (GGUF shapes are
    # reversed: [hidden, vocab]).
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    eos_ids = [
        read_field(reader, f"tokenizer.ggml.{k}", None)
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    bos = read_field(reader, "tokenizer.ggml.bos_token_id", None)
    return ModelSpec(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        checkpoint_dtype="float32",
    )


def rope_heads_for(reader_arch: str, hf_name: str, spec: ModelSpec) -> int | None:
    """Head count to pass to `undo_rope_permutation` for this tensor, or None if not permuted."""
    if not _GGUF_ARCHITECTURES.get(reader_arch, False):
        return None
    if hf_name.endswith("self_attn.q_proj.weight") or hf_name.endswith("self_attn.q_proj.bias"):
        return spec.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight") or hf_name.endswith("self_attn.k_proj.bias"):
        return spec.num_key_value_heads
    return None


def iter_raw_tensors(reader: GGUFReader) -> Iterator[tuple[str, ReaderTensor]]:
    """(hf_name, ReaderTensor) for every weight tensor, in file order."""
    for tensor in reader.tensors:
        if tensor.name in _NON_WEIGHT_TENSORS:
            continue
        yield gguf_to_hf_name(tensor.name), tensor


def iter_dequantized(reader: GGUFReader, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, float32 tensor in HF layout) for every weight, rope permutation undone."""
    gguf_arch = read_field(reader, "general.architecture")
    for hf_name, tensor in iter_raw_tensors(reader):
        yield hf_name, dequantize_tensor(tensor, rope_heads_for(gguf_arch, hf_name, spec))


def dequantize_tensor(tensor: ReaderTensor, rope_heads: int | None = None) -> torch.Tensor:
    """One GGUF tensor as float32 in HF layout ([out_features, in_features] for matrices)."""
    # tensor.data is [rows, bytes or elements per row]; dequantize gives [rows, in_features],
    # which is HF's [out, in] since GGUF lists dims innermost-first.
    hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type == GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    array = np.ascontiguousarray(array.reshape(hf_shape))
    if rope_heads is not None:
        array = np.ascontiguousarray(undo_rope_permutation(array, rope_heads))
    return torch.from_numpy(array)


def _gguf_rope_scaling(
    reader: GGUFReader,
    gguf_arch: str,
    tensors: dict[str, ReaderTensor],
    head_dim: int,
    rope_theta: float,
    context_length: int,
) -> dict | None:
    scaling_type = read_field(reader, f"{gguf_arch}.rope.scaling.type", None)
    if scaling_type in ("linear", "yarn"):
        factor = float(read_field(reader, f"{gguf_arch}.rope.scaling.factor"))
        out: dict[str, Any] = {"rope_type": scaling_type, "factor": factor}
        original = read_field(reader, f"{gguf_arch}.rope.scaling.original_context_length", None)
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        return out
    if scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope.scaling.type {scaling_type!r} is not supported (linear, yarn)")
    if "rope_freqs.weight" in tensors:
        factors = dequantize_tensor(tensors["rope_freqs.weight"]).double()
        return _llama3_scaling_from_factors(factors, head_dim, rope_theta)
    return None


def _llama3_scaling_from_factors(factors: torch.Tensor, head_dim: int, theta: float) -> dict:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's per-frequency `rope_freqs` tensor.

    llama.cpp stores only the resulting divisors (one per rotary frequency). Any parameters that
    reproduce them give an identical model, so we search the small space Llama 3.x uses.
    """
    import math

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    for original in (8192, 4096, 2048, 16384, 32768):
        for low in (1.0, 2.0):
            for high in (4.0, 2.0, 8.0):
                low_wavelen, high_wavelen = original / low, original / high
                smooth = (original / wavelen - low) / (high - low)
                expected = torch.where(
                    wavelen < high_wavelen,
                    torch.ones_like(wavelen),
                    torch.where(
                        wavelen > low_wavelen,
                        torch.full_like(wavelen, factor),
                        1.0 / ((1 - smooth) / factor + smooth),
                    ),
                )
                if torch.allclose(expected, factors, rtol=1e-4, atol=1e-5):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": original,
                    }
    raise ValueError("GGUF rope_freqs tensor does not match llama3 rope scaling; not supported")
