"""Pre-quantized Hugging Face folders (GPTQ, AWQ): detect them, stream their weights.

`config.json`'s `quantization_config` says which layout the safetensors hold; the packed
tensors are turned into canonical `Int4Weight`s here, every other tensor passes through.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from argosy_runtime.quantization.awq import AWQ_SUFFIXES, awq_to_int4
from argosy_runtime.quantization.config import INT4_GROUP_SIZES, QuantizationConfig
from argosy_runtime.quantization.gptq import GPTQ_SUFFIXES, gptq_to_int4
from argosy_runtime.quantization.rtn import Int4Weight

_PROJ_SHAPES = {  # HF projection -> (in_features, out_features) from the spec
    "q_proj": lambda s: (s.hidden_size, s.num_attention_heads * s.head_dim),
    "k_proj": lambda s: (s.hidden_size, s.num_key_value_heads * s.head_dim),
    "v_proj": lambda s: (s.hidden_size, s.num_key_value_heads * s.head_dim),
    "o_proj": lambda s: (s.num_attention_heads * s.head_dim, s.hidden_size),
    "gate_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "up_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "down_proj": lambda s: (s.intermediate_size, s.hidden_size),
}
_BIASED = ("q_proj", "k_proj", "v_proj")  # the only projections with a bias (attention_bias)


def read_quantization_config(checkpoint: Any) -> dict | None:
    """config.json's `quantization_config` of an HF folder, or None (GGUF files: None)."""
    if checkpoint.format != "hf":
        return None
    path = checkpoint.path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def detect_prequantized(checkpoint: Any) -> QuantizationConfig | None:
    """The QuantizationConfig a GPTQ/AWQ folder was written with, None for a plain one.

    Raises ValueError for a quantization_config we cannot load (other methods, bits,
    group sizes, AWQ's GEMV layout, GPTQ without zero points...).
    """
    qc = read_quantization_config(checkpoint)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"config.json quantization_config.quant_method {method!r} is not "
                         "supported (supported: gptq, awq)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with bits={bits} are not supported (only 4)")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{method} quantization_config.group_size={group_size} is not supported "
                         f"(supported: {', '.join(map(str, INT4_GROUP_SIZES))})")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only the 'gemm' layout)")
        if qc.get("zero_point", True) is False:
            raise ValueError("AWQ without zero points is not supported")
    else:
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return QuantizationConfig(method="int4", group_size=int(group_size), source=method)


def iter_prequantized(checkpoint: Any, config: QuantizationConfig
                      ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """(HF name, tensor or Int4Weight) for every weight of a GPTQ/AWQ folder, named as the
    model expects (`model.` in front of a headless checkpoint's names).

    Quantized projections come as `<module>.weight` -> Int4Weight. All-zero biases that
    AutoGPTQ writes for layers without one are dropped; a non-zero one is an error.
    """
    from argosy_runtime.model_loader.hf_checkpoint import model_weight_name, safetensors_files

    spec = checkpoint.spec
    qc = read_quantization_config(checkpoint) or {}
    zero_offset = 1 if str(qc.get("checkpoint_format", "gptq")).lower() == "gptq" else 0
    suffixes = GPTQ_SUFFIXES if config.source == "gptq" else AWQ_SUFFIXES
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for file in safetensors_files(checkpoint.path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = model_weight_name(key)  # a headless checkpoint has no `model.` prefix
                module, _, leaf = name.rpartition(".")
                proj = module.rsplit(".", 1)[-1]
                if leaf in suffixes and proj in _PROJ_SHAPES:
                    parts.setdefault(module, {})[leaf] = f.get_tensor(key)
                    continue
                if leaf == "weight" and proj in _PROJ_SHAPES and module.startswith("model.layers."):
                    raise ValueError(
                        f"{file.name}: {key} is unquantized in a {config.source} checkpoint "
                        "(every projection must be quantized)")
                if leaf == "bias" and proj in _PROJ_SHAPES and not (
                        proj in _BIASED and spec.attention_bias):
                    tensor = f.get_tensor(key)
                    if torch.count_nonzero(tensor):
                        raise ValueError(f"{file.name}: unexpected non-zero bias {key}")
                    continue
                if key.endswith(".rotary_emb.inv_freq"):
                    continue
                yield name, f.get_tensor(key)
    for module, tensors in parts.items():
        in_f, out_f = _PROJ_SHAPES[module.rsplit(".", 1)[-1]](spec)
        if config.source == "gptq":
            weight = gptq_to_int4(module, tensors, in_f, out_f, config.group_size, zero_offset)
        else:
            weight = awq_to_int4(module, tensors, in_f, out_f, config.group_size)
        yield f"{module}.weight", weight
