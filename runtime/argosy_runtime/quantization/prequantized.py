"""Pre-quantized Hugging Face folders (GPTQ, AWQ): detect them, stream their weights.

`config.json`'s `quantization_config` (or an older export's quantize_config.json /
quant_config.json) says which layout the safetensors hold; the packed
tensors are turned into canonical `Int4Weight`s here, every other tensor passes through.
Phi-3's fused `qkv_proj` / `gate_up_proj` layers are split into their projections first
(`split_fused_quantized`), as the float loader splits their rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from argosy_runtime.model_loader.hf_checkpoint import read_json
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
    """config.json's `quantization_config` of an HF folder, or None (GGUF files: None).

    Without one, the file older exports wrote beside config.json instead: AutoGPTQ's
    `quantize_config.json` (GPTQ fields, often no quant_method), AutoAWQ's
    `quant_config.json` (`w_bit`, `q_group_size`; some AWQ exports name it
    quantize_config.json). gptqmodel reads these; without them such a folder loaded as a
    float model and failed on its first `qweight` tensor.
    """
    if checkpoint.format != "hf":
        return None
    qc = read_json(checkpoint.path / "config.json").get("quantization_config")
    if isinstance(qc, dict):
        return qc
    for name in ("quantize_config.json", "quant_config.json"):
        path = checkpoint.path / name
        legacy = read_json(path) if path.is_file() else {}
        if "w_bit" in legacy:  # AutoAWQ's names
            return {"quant_method": "awq", "bits": legacy["w_bit"],
                    "group_size": legacy.get("q_group_size"),
                    "zero_point": legacy.get("zero_point", True),
                    "version": legacy.get("version", "gemm")}
        if "bits" in legacy:
            return {"quant_method": "gptq", **legacy}
    return None


def detect_prequantized(checkpoint: Any) -> QuantizationConfig | None:
    """The QuantizationConfig a GPTQ/AWQ folder was written with, None for a plain one.

    Raises ValueError for a quantization_config we cannot load (other methods, bits,
    group sizes, layouts other than GPTQ v1/v2 and AWQ GEMM, AWQ without zero points,
    gptqmodel's per-module `dynamic` overrides, a quantized lm_head...).
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
    fmt = checkpoint_format(qc)
    if method == "awq":
        if fmt != "gemm":
            raise ValueError(f"AWQ version {fmt!r} is not supported (only the 'gemm' layout)")
        if qc.get("zero_point", True) is False:
            raise ValueError("AWQ without zero points is not supported")
    elif fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    # Layouts and per-module exceptions (gptqmodel, AutoGPTQ) we do not read: ignored, they
    # would load wrong tensors or fail later on a shape, with a message that hides why.
    if qc.get("is_marlin_format"):
        raise ValueError(f"{method} is_marlin_format checkpoints are not supported")
    if str(qc.get("pack_dtype", "int32")).lower().removeprefix("torch.") != "int32":
        raise ValueError(f"{method} quantization_config.pack_dtype={qc['pack_dtype']!r} is not "
                         "supported (only int32)")
    if qc.get("dynamic"):
        raise ValueError(f"{method} quantization_config.dynamic (per-module overrides of bits, "
                         "group size or skipped modules) is not supported")
    if qc.get("lm_head"):
        raise ValueError(f"{method} checkpoints with a quantized lm_head (quantization_config."
                         "lm_head=true) are not supported")
    return QuantizationConfig(method="int4", group_size=int(group_size), source=method)


def checkpoint_format(qc: dict) -> str:
    """The packing layout a GPTQ/AWQ `quantization_config` names, read as transformers'
    GPTQConfig / AwqConfig read it (lower case).

    GPTQ: `checkpoint_format` (AutoGPTQ, gptqmodel), else `format` (the name transformers
    and gptqmodel use in code, and that some exports write alone), else "gptq" (v1).
    AWQ: `version` (AutoAWQ), else `format`, else "gemm"; `backend` "llm-awq" names
    llm-awq's own layout.
    """
    if str(qc.get("quant_method", "")).lower() == "awq":
        if str(qc.get("backend", "")).lower() == "llm-awq":
            return "llm-awq"
        names, default = ("version", "format"), "gemm"
    else:
        names, default = ("checkpoint_format", "format"), "gptq"
    for name in names:
        if qc.get(name) is not None:
            return str(qc[name]).lower()
    return default


def iter_prequantized(checkpoint: Any, config: QuantizationConfig
                      ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """(HF name, tensor or Int4Weight) for every weight of a GPTQ/AWQ folder, named as the
    model expects (`model.` in front of a headless checkpoint's names).

    Quantized projections come as `<module>.weight` -> Int4Weight; a Phi-3 fused layer
    (`qkv_proj`, `gate_up_proj`) comes as its projections' (q/k/v, gate/up), which the model
    fuses again. All-zero biases that AutoGPTQ writes for layers without one are dropped; a
    non-zero one is an error.
    """
    from argosy_runtime.model_loader.hf_checkpoint import (
        model_weight_name,
        phi3_fused_parts,
        safetensors_files,
    )

    spec = checkpoint.spec
    qc = read_quantization_config(checkpoint) or {}
    zero_offset = 1 if checkpoint_format(qc) == "gptq" else 0  # v1 stores zero - 1
    suffixes = GPTQ_SUFFIXES if config.source == "gptq" else AWQ_SUFFIXES

    def fused_parts(module: str) -> tuple[list[str], list[int]] | None:
        return phi3_fused_parts(module, spec) if spec.architecture == "phi3" else None

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for file in safetensors_files(checkpoint.path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = model_weight_name(key)  # a headless checkpoint has no `model.` prefix
                module, _, leaf = name.rpartition(".")
                proj = module.rsplit(".", 1)[-1]
                fused = fused_parts(module)
                quantized = proj in _PROJ_SHAPES or fused is not None
                if leaf in suffixes and quantized:
                    parts.setdefault(module, {})[leaf] = f.get_tensor(key)
                    continue
                if leaf == "weight" and quantized and module.startswith("model.layers."):
                    raise ValueError(
                        f"{file.name}: {key} is unquantized in a {config.source} checkpoint "
                        "(every projection must be quantized)")
                if leaf == "bias" and quantized:
                    tensor = f.get_tensor(key)
                    # A fused bias holds its projections' biases one after the other, like the
                    # rows of the fused weight.
                    if fused is not None and tuple(tensor.shape) != (sum(fused[1]),):
                        raise ValueError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, "
                                         f"expected ({sum(fused[1])},)")
                    pieces = (zip(fused[0], tensor.split(fused[1])) if fused is not None
                              else [(module, tensor)])
                    for part, bias in pieces:
                        if part.rsplit(".", 1)[-1] in _BIASED and spec.attention_bias:
                            yield f"{part}.bias", bias
                        elif torch.count_nonzero(bias):
                            raise ValueError(f"{file.name}: unexpected non-zero bias {key}")
                    continue
                if key.endswith(".rotary_emb.inv_freq"):
                    continue
                yield name, f.get_tensor(key)
    for module, tensors in parts.items():
        fused = fused_parts(module)
        pieces = ([(module, tensors)] if fused is None else
                  zip(fused[0], split_fused_quantized(module, tensors, fused[1], config.source)))
        for part, part_tensors in pieces:
            in_f, out_f = _PROJ_SHAPES[part.rsplit(".", 1)[-1]](spec)
            if config.source == "gptq":
                weight = gptq_to_int4(part, part_tensors, in_f, out_f, config.group_size,
                                      zero_offset)
            else:
                weight = awq_to_int4(part, part_tensors, in_f, out_f, config.group_size)
            yield f"{part}.weight", weight


def split_fused_quantized(module: str, tensors: dict[str, torch.Tensor], sizes: list[int],
                          source: str) -> list[dict[str, torch.Tensor]]:
    """The GPTQ/AWQ tensors of a fused layer (Phi-3's qkv_proj / gate_up_proj) split into its
    projections', whose output sizes are `sizes` (views, no copy).

    Exporters quantize the fused layer as one linear, and each output column is quantized on
    its own, so the fused tensors are the projections' tensors side by side along the output
    dimension: one column per output in `scales` [ng, N] and GPTQ's `qweight` [K / 8, N]
    (packed along the input), eight outputs per int32 in `qzeros` [ng, N / 8] and AWQ's
    `qweight` [K, N / 8] (packed along the output; AWQ's interleaved nibble order stays inside
    one int32, so a cut between int32s is exact). GPTQ's `g_idx` [K] numbers the input groups,
    which every projection shares. Raises ValueError when a projection's outputs do not start
    and end on an int32 boundary, or a tensor is not as wide as the layer.
    """
    if any(size % 8 for size in sizes):
        raise ValueError(f"{module}: its projections' output sizes {sizes} are not all "
                         "multiples of 8, so its packed qzeros cannot be split between them")
    packed = [size // 8 for size in sizes]
    widths = {"scales": sizes, "qzeros": packed, "qweight": sizes if source == "gptq" else packed}
    split: list[dict[str, torch.Tensor]] = [{} for _ in sizes]
    for leaf, tensor in tensors.items():
        if leaf == "g_idx":
            pieces = [tensor] * len(sizes)
        elif tensor.dim() != 2 or tensor.shape[1] != sum(widths[leaf]):
            raise ValueError(f"{module}.{leaf} has shape {tuple(tensor.shape)}, expected "
                             f"{sum(widths[leaf])} columns for this model's layer (the "
                             "checkpoint's quantization layout does not match its config)")
        else:
            pieces = tensor.split(widths[leaf], dim=1)
        for part, piece in zip(split, pieces):
            part[leaf] = piece
    return split
