"""GGUF files: hyperparameters from metadata, tensors renamed to HF names and dequantized.

llama.cpp's converter stores Llama's q_proj/k_proj rows permuted (it interleaves the two
rotary halves of every head, matching ggml's "normal" rope), so we undo that permutation to get
exactly the tensors transformers has; Mixtral, filed under "llama", is permuted the same way.
Qwen2/Qwen3 (and their MoE versions), Phi-3 and Gemma 3 files are not permuted (ggml uses NEOX
rope there).

Beyond the dense Llama layout, llama.cpp's converter (convert_hf_to_gguf.py) writes:
- Mixture-of-Experts (qwen2moe, qwen3moe, and Mixtral as "llama" with `llama.expert_count`):
  each sparse layer's experts merged into 3-D `blk.N.ffn_{gate,up,down}_exps.weight`
  ([experts, out, in] in HF order), the router as `ffn_gate_inp`, Qwen2-MoE's shared expert as
  `ffn_{gate,up,down}_shexp` + `ffn_gate_inp_shexp` ([hidden] or [1, hidden]); metadata
  `{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length`,
  `expert_shared_feed_forward_length`. A layer without `ffn_gate_inp` is dense. Mixtral files
  from before the merge hold one tensor per expert (`blk.N.ffn_gate.E.weight`): read too.
- phi3: `attn_qkv` (q rows, then k, then v) and `ffn_up` holding gate then up (HF's own fused
  `qkv_proj` / `gate_up_proj`); partial rotary as `rope.dimension_count` < head_dim; longrope
  as `rope_factors_long/short` tensors with `rope.scaling.attn_factor` and
  `rope.scaling.original_context_length`; `attention.sliding_window` 0 for none.
- gemma3: every `*norm.weight` stored as 1 + the HF weight (Gemma3RMSNorm scales by 1 + w),
  `post_attention_norm` / `ffn_norm` (pre-feedforward) / `post_ffw_norm`. Neither the layer
  pattern, nor the sliding layers' rotary base, nor query_pre_attn_scalar is written: llama.cpp
  fixes them (every 6th layer full attention, base 10000, scale head_dim ** -0.5 except
  Gemma-3-27B's (hidden / heads) ** -0.5); we follow it, reading
  `attention.sliding_window_pattern` / `rope.freq_base_swa` where a file has them.
- gemma2: gemma3's tensors without q/k norms, one rotary base; llama.cpp fixes the pattern
  (the even layers slide) and the scale (as gemma3's, Gemma-2-27B: 46 layers); the soft caps
  are `attn_logit_softcapping` / `final_logit_softcapping` (default 50 / 30, as llama.cpp).
We yield the HF per-projection / per-expert names `hf_checkpoint.expected_weight_names` lists.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from argosy_runtime.model_loader.gguf_metadata import read_field
from argosy_runtime.model_loader.hf_checkpoint import (
    expert_weight_name,
    moe_router_name,
    split_phi3_fused,
)
from argosy_runtime.model_loader.model_spec import ModelSpec

# general.architecture values we read -> (our architecture, whether q/k rows are rope-permuted).
# "llama" with an expert_count is Mixtral; "llama" named Mistral is Mistral (spec_from_gguf).
_GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
    "qwen2moe": ("qwen2_moe", False), "qwen3moe": ("qwen3_moe", False),
    "phi3": ("phi3", False), "gemma2": ("gemma2", False), "gemma3": ("gemma3", False),
}

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
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3, qwen3moe, gemma3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # MoE router and Qwen2-MoE's shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Gemma 2 / 3's four norms per layer: llama.cpp's ffn_norm is the pre-feedforward norm there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Merged experts: GGUF name -> the projection (hf_checkpoint.expert_weight_name's `proj`).
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
                   "ffn_down_exps.weight": "down"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Mixtral files from before llama.cpp merged the experts (early 2024): blk.N.ffn_gate.E.weight.
_LEGACY_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
# Tensors that are not weights of the HF model: llama.cpp's precomputed llama3 rope factors,
# Phi-3's longrope factor lists (read into the spec's rope_scaling).
_NON_WEIGHT_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Gemma 3 in llama.cpp (llama-model.cpp): the sliding layers' rotary base and layer pattern;
# Gemma 2's pattern, window and soft caps where a file does not say.
_GEMMA3_LOCAL_THETA, _GEMMA3_PATTERN = 10_000.0, 6
_GEMMA2_PATTERN, _GEMMA2_WINDOW, _GEMMA2_ATTN_CAP, _GEMMA2_FINAL_CAP = 2, 4096, 50.0, 30.0
# The layer count of the largest size, whose query scale is (hidden / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)
RawItem = ReaderTensor | torch.Tensor


def gguf_to_hf_name(gguf_name: str, gguf_arch: str = "llama") -> str:
    """HF parameter name of a GGUF tensor that maps one to one ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"). Merged experts and Phi-3's fused tensors map to
    several HF tensors: `iter_raw_tensors` splits those."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    names = _GEMMA3_LAYER_NAMES if gguf_arch in ("gemma2", "gemma3") else _LAYER_NAMES
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in a supported model")


def undo_rope_permutation(weights: ArrayT, num_heads: int) -> ArrayT:
    """Undo llama.cpp's q/k row permutation. `weights`: [num_heads * head_dim, ...].

    llama.cpp wrote rows of each head as (head_dim/2, 2) -> reshaped to (2, head_dim/2); we swap
    back. Works on any array whose first axis is the output rows, including still-quantized
    block data ([rows, bytes_per_row]) since quantization blocks run along a row.
    """
    rows = weights.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads):  # a malformed file: say so, not "cannot reshape"
        raise ValueError(f"its {rows} rows do not split into {num_heads} heads of an even "
                         "head_dim")
    half = rows // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    if isinstance(w, torch.Tensor):
        return w.transpose(1, 2).reshape(weights.shape)
    return w.swapaxes(2, 1).reshape(weights.shape)


SPLIT_HINT = ("merge the parts into one file first (llama.cpp: llama-gguf-split --merge "
              "<first part> <merged>.gguf) and pass that")


def check_not_split(reader: GGUFReader, path: Path) -> None:
    """ValueError for one part of a model llama.cpp's gguf-split cut into several files
    (`split.count` > 1): only the first part has the metadata, each part some of the tensors,
    and this loader reads one file (it would miss the others' tensors)."""
    count = int(read_field(reader, "split.count", 0) or 0)
    if count > 1:
        part = int(read_field(reader, "split.no", 0) or 0) + 1
        raise ValueError(f"{path} is part {part} of {count} of a split GGUF model; "
                         f"{SPLIT_HINT}")


def spec_from_gguf(reader: GGUFReader) -> ModelSpec:
    """The `ModelSpec` of a GGUF file, from its `{arch}.*` metadata and tensor list."""
    gguf_arch = read_field(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF general.architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    architecture = _GGUF_ARCHITECTURES[gguf_arch][0]
    expert_count = int(read_field(reader, f"{gguf_arch}.expert_count", 0) or 0)
    if gguf_arch == "llama" and expert_count > 0:
        architecture = "mixtral"
    # llama.cpp files Mistral under "llama"; the name is the only hint (transformers does the same).
    elif gguf_arch == "llama" and "mistral" in str(read_field(reader, "general.name", "")).lower():
        architecture = "mistral"

    def meta(key: str, default: Any = ...) -> Any:
        full = f"{gguf_arch}.{key}"
        return read_field(reader, full) if default is ... else read_field(reader, full, default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    if num_heads <= 0:  # before dividing by it
        raise ValueError(f"GGUF {gguf_arch}.attention.head_count must be a positive integer, "
                         f"got {num_heads}")
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    partial_rotary_factor = 1.0
    if rope_dims != head_dim:
        if architecture != "phi3":
            raise ValueError(f"GGUF rope.dimension_count {rope_dims} != head_dim {head_dim} "
                             "(partial rotary) is only supported for phi3")
        partial_rotary_factor = rope_dims / head_dim
    num_layers = int(meta("block_count"))
    rope_theta = float(meta("rope.freq_base", 10000.0))
    context_length = int(meta("context_length"))
    if architecture == "phi3":
        rope_scaling = _phi3_rope_scaling(reader, tensors, context_length)
    else:
        rope_scaling = _gguf_rope_scaling(reader, gguf_arch, tensors, head_dim, rope_theta,
                                          context_length)
    # The embedding's row count is the vocabulary the model was trained with (GGUF shapes are
    # reversed: [hidden, vocab]).
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    eos_ids = [
        read_field(reader, f"tokenizer.ggml.{k}", None)
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    bos = read_field(reader, "tokenizer.ggml.bos_token_id", None)
    moe = _gguf_moe(reader, gguf_arch, architecture, tensors, num_layers, expert_count)
    intermediate = meta("feed_forward_length", None)
    if intermediate is None:  # an all-sparse MoE file may omit it: no dense MLP uses it
        intermediate = moe.get("moe_intermediate_size")
    window = int(meta("attention.sliding_window", 0) or 0)
    extra: dict[str, Any] = {}
    windows: tuple[int | None, ...] = ()
    if architecture == "phi3" and 0 < window < context_length:
        windows = (window,) * num_layers  # Phi-3-mini-4k; 0 (Phi-4) or >= context: none
    if architecture in ("gemma2", "gemma3"):
        extra, windows = _gemma_fields(reader, gguf_arch, num_layers, hidden, num_heads,
                                       head_dim, window)
    return ModelSpec(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(intermediate),
        num_hidden_layers=num_layers,
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
        layer_sliding_windows=windows,
        partial_rotary_factor=partial_rotary_factor,
        **moe,
        **extra,
    )


def _gguf_moe(reader: GGUFReader, gguf_arch: str, architecture: str,
              tensors: dict[str, ReaderTensor], num_layers: int, expert_count: int) -> dict:
    """The Mixture-of-Experts fields of the spec ({} for a dense model). A layer is sparse when
    it has a router (`ffn_gate_inp`); sizes fall back to the expert tensors' shapes."""
    if architecture not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    sparse = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    if expert_count <= 0 or not sparse:
        raise ValueError(f"GGUF {gguf_arch} file has no experts ({gguf_arch}.expert_count "
                         f"{expert_count}, {len(sparse)} layers with ffn_gate_inp)")
    first = sparse[0]
    # GGUF shapes are reversed: ffn_gate_exps is [hidden, moe_intermediate, experts] (an old
    # Mixtral file's per-expert ffn_gate.0 [hidden, intermediate]).
    gate = tensors.get(f"blk.{first}.ffn_gate_exps.weight",
                       tensors.get(f"blk.{first}.ffn_gate.0.weight"))
    key = "feed_forward_length" if architecture == "mixtral" else "expert_feed_forward_length"
    moe_size = read_field(reader, f"{gguf_arch}.{key}", None)
    if moe_size is None and gate is None:
        raise ValueError(f"GGUF {gguf_arch} file has neither {gguf_arch}.{key} nor "
                         f"blk.{first}.ffn_gate_exps.weight")
    moe_size = int(moe_size if moe_size is not None else gate.shape[1])
    shared = 0
    if architecture == "qwen2_moe":
        shexp = tensors.get(f"blk.{first}.ffn_up_shexp.weight")
        shared = int(read_field(reader, f"{gguf_arch}.expert_shared_feed_forward_length",
                                int(shexp.shape[1]) if shexp is not None else 0))
    # llama.cpp renormalizes the top-k weights for Mixtral and Qwen3-MoE, not Qwen2-MoE (its
    # graphs hard-code it); newer files may say so in expert_weights_norm.
    norm = bool(read_field(reader, f"{gguf_arch}.expert_weights_norm",
                           architecture != "qwen2_moe"))
    return dict(num_experts=expert_count,
                num_experts_per_tok=int(read_field(reader, f"{gguf_arch}.expert_used_count")),
                moe_intermediate_size=moe_size, norm_topk_prob=norm or architecture == "mixtral",
                shared_expert_intermediate_size=shared, sparse_layers=sparse)


def _phi3_rope_scaling(reader: GGUFReader, tensors: dict[str, ReaderTensor],
                       context_length: int) -> dict | None:
    """Phi-3's longrope from llama.cpp's `rope_factors_long/short` tensors (None without them),
    in the layout `model_spec._phi3_rope` builds from config.json."""
    if "rope_factors_long.weight" not in tensors:
        return None
    if "rope_factors_short.weight" not in tensors:
        raise ValueError("GGUF phi3 file has rope_factors_long but no rope_factors_short")
    original = int(read_field(reader, "phi3.rope.scaling.original_context_length", context_length))
    attention_factor = read_field(reader, "phi3.rope.scaling.attn_factor", None)
    if attention_factor is None:  # what the converter computes (longrope)
        scale = context_length / original
        attention_factor = (math.sqrt(1 + math.log(scale) / math.log(original))
                            if scale > 1.0 else 1.0)
    return {
        "rope_type": "longrope",
        "short_factor": dequantize_tensor(tensors["rope_factors_short.weight"]).tolist(),
        "long_factor": dequantize_tensor(tensors["rope_factors_long.weight"]).tolist(),
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def _gemma_fields(reader: GGUFReader, arch: str, num_layers: int, hidden: int, num_heads: int,
                  head_dim: int, window: int) -> tuple[dict, tuple[int | None, ...]]:
    """(Gemma-only ModelSpec fields, per-layer windows) as llama.cpp's gemma2 / gemma3 graph
    sets them (`arch`: the file's general.architecture)."""
    gemma2 = arch == "gemma2"
    if gemma2 and window <= 0:
        window = _GEMMA2_WINDOW  # llama.cpp's default n_swa for gemma2
    pattern = read_field(reader, f"{arch}.attention.sliding_window_pattern",
                         _GEMMA2_PATTERN if gemma2 else _GEMMA3_PATTERN)
    if isinstance(pattern, list):  # per layer: true = sliding
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern(n): every n-th layer is full attention (0: none slides)
        n = int(pattern)
        sliding = [n > 0 and i % n < n - 1 for i in range(num_layers)]
    if any(sliding) and window <= 0:
        raise ValueError(f"GGUF {arch} file has sliding-window layers but no "
                         f"{arch}.attention.sliding_window")
    windows = tuple(window if s else None for s in sliding)
    # Gemma-2-27B (46 layers) and Gemma-3-27B (62) scale queries by (hidden / heads) ** -0.5,
    # the others by head_dim ** -0.5 (llama.cpp's f_attention_scale = transformers'
    # query_pre_attn_scalar).
    scalar = hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim
    cap = read_field(reader, f"{arch}.final_logit_softcapping", _GEMMA2_FINAL_CAP if gemma2 else None)
    extra = dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=float(scalar),
                 final_logit_softcapping=float(cap) if cap else None)
    if gemma2:  # llama.cpp soft-caps gemma2's attention always (attn_soft_cap)
        attn_cap = read_field(reader, "gemma2.attn_logit_softcapping", _GEMMA2_ATTN_CAP)
        extra["attn_logit_softcapping"] = float(attn_cap) if attn_cap else None
    else:
        extra["local_rope_theta"] = float(read_field(reader, "gemma3.rope.freq_base_swa",
                                                     _GEMMA3_LOCAL_THETA))
    return extra, windows if any(sliding) else ()


def rope_heads_for(reader_arch: str, hf_name: str, spec: ModelSpec) -> int | None:
    """Head count to pass to `undo_rope_permutation` for this tensor, or None if not permuted."""
    if not _GGUF_ARCHITECTURES.get(reader_arch, ("", False))[1]:
        return None
    if hf_name.endswith("self_attn.q_proj.weight") or hf_name.endswith("self_attn.q_proj.bias"):
        return spec.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight") or hf_name.endswith("self_attn.k_proj.bias"):
        return spec.num_key_value_heads
    return None


def iter_raw_tensors(reader: GGUFReader, spec: ModelSpec | None = None
                     ) -> Iterator[tuple[str, RawItem]]:
    """(hf_name, tensor) for every weight, in file order, named as `expected_weight_names` says.

    A tensor that maps one to one comes as the gguf ReaderTensor, still in its stored
    quantization (q/k rows of Llama-family files still permuted: see `rope_heads_for`). One
    that llama.cpp stores differently comes dequantized as a float32 torch tensor in HF layout:
    merged experts split per expert, Phi-3's fused qkv / gate-up split, Gemma 2/3's norms less
    the 1 the converter added, Qwen2-MoE's shared-expert gate as [1, hidden].
    `spec` (`spec_from_gguf(reader)` when None) gives the split sizes.
    """
    gguf_arch = read_field(reader, "general.architecture")
    if spec is None:
        spec = spec_from_gguf(reader)
    for tensor in reader.tensors:
        if tensor.name in _NON_WEIGHT_TENSORS:
            continue
        match = _LAYER_RE.match(tensor.name)
        short = match.group(2) if match else ""
        if short in _EXPERT_TENSORS:
            yield from _split_experts(tensor, int(match.group(1)), short, spec)
            continue
        if spec.architecture == "phi3" and short in ("attn_qkv.weight", "ffn_up.weight"):
            layer = int(match.group(1))
            fused = ("self_attn.qkv_proj" if short == "attn_qkv.weight" else "mlp.gate_up_proj")
            name = f"model.layers.{layer}.{fused}.weight"
            split = split_phi3_fused(name, dequantize_tensor(tensor), spec)
            assert split is not None
            yield from ((n, t.contiguous()) for n, t in split)
            continue
        legacy = _LEGACY_EXPERT_RE.match(short) if spec.architecture == "mixtral" else None
        if legacy:  # early Mixtral files: one tensor per expert, kept as stored
            yield expert_weight_name(spec, int(match.group(1)), int(legacy.group(2)),
                                     legacy.group(1)), tensor
            continue
        hf_name = gguf_to_hf_name(tensor.name, gguf_arch)
        if short == "ffn_gate_inp.weight":  # the router
            hf_name = moe_router_name(spec, int(match.group(1)))
        if spec.is_gemma and tensor.name.endswith("norm.weight"):
            yield hf_name, dequantize_tensor(tensor) - 1.0
        elif short == "ffn_gate_inp_shexp.weight":
            yield hf_name, dequantize_tensor(tensor).reshape(1, spec.hidden_size)
        else:
            yield hf_name, tensor


def _split_experts(tensor: ReaderTensor, layer: int, short: str, spec: ModelSpec
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One merged expert tensor ([experts, out, in] once dequantized) as per-expert HF weights."""
    proj = _EXPERT_TENSORS[short]
    stacked = dequantize_tensor(tensor)
    inter, hidden = spec.moe_intermediate_size, spec.hidden_size
    expected = (spec.num_experts, hidden, inter) if proj == "down" else (
        spec.num_experts, inter, hidden)
    if tuple(stacked.shape) != expected:
        raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tuple(stacked.shape)} "
                         f"(experts, out, in); the model expects {expected}")
    for e in range(spec.num_experts):
        yield expert_weight_name(spec, layer, e, proj), stacked[e]


def iter_dequantized(reader: GGUFReader, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, float32 tensor in HF layout) for every weight, rope permutation undone."""
    gguf_arch = read_field(reader, "general.architecture")
    for hf_name, tensor in iter_raw_tensors(reader, spec):
        if isinstance(tensor, torch.Tensor):
            yield hf_name, tensor
        else:
            yield hf_name, dequantize_tensor(tensor, rope_heads_for(gguf_arch, hf_name, spec))


def dequantize_tensor(tensor: ReaderTensor, rope_heads: int | None = None) -> torch.Tensor:
    """One GGUF tensor as float32 in HF layout ([out_features, in_features] for matrices,
    [experts, out, in] for merged experts)."""
    # tensor.data is [rows, bytes or elements per row]; dequantize gives [rows, in_features],
    # which is HF's [out, in] since GGUF lists dims innermost-first.
    hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type == GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)
    else:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:  # gguf-py: I8..I64, F64, Q8_1, Q8_K
            raise ValueError(f"GGUF tensor {tensor.name}: type {tensor.tensor_type.name} is not "
                             f"supported ({exc})") from exc
    array = np.ascontiguousarray(array.reshape(hf_shape))
    if rope_heads is not None:
        try:
            array = np.ascontiguousarray(undo_rope_permutation(array, rope_heads))
        except ValueError as exc:
            raise ValueError(f"GGUF tensor {tensor.name} of shape {hf_shape}: {exc}") from exc
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
    if scaling_type not in (None, "none", "linear", "yarn"):
        raise ValueError(f"GGUF rope.scaling.type {scaling_type!r} is not supported (linear, yarn)")
    # As llama.cpp reads it (llama-model.cpp load_hparams): the factor is optional, else the
    # 2023 converters' `rope.scale_linear` (written with no scaling.type: llama.cpp's default
    # type is linear), and 0 or absent means no scaling (freq_scale 1).
    factor = read_field(reader, f"{gguf_arch}.rope.scaling.factor", None)
    if factor is None:
        factor = read_field(reader, f"{gguf_arch}.rope.scale_linear", None)
    factor = float(factor or 0.0)
    if not factor >= 0.0:  # negative or NaN: rotations llama.cpp would garble too
        raise ValueError(f"GGUF {gguf_arch}.rope.scaling.factor must be positive, got {factor}")
    linear = scaling_type == "linear" or (scaling_type is None and factor not in (0.0, 1.0))
    if scaling_type == "yarn" or (linear and factor):
        out: dict[str, Any] = {"rope_type": scaling_type or "linear", "factor": factor or 1.0}
        original = read_field(reader, f"{gguf_arch}.rope.scaling.original_context_length", None)
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        if scaling_type == "yarn":  # (llama.cpp's n_ctx_orig_yarn defaults to the context too)
            out.setdefault("original_max_position_embeddings", context_length)
            out.update(_gguf_yarn_fields(reader, gguf_arch))
        return out
    if "rope_freqs.weight" in tensors:
        factors = dequantize_tensor(tensors["rope_freqs.weight"]).double()
        return _llama3_scaling_from_factors(factors, head_dim, rope_theta)
    return None


# The optional yarn keys llama.cpp's convert_hf_to_gguf.py writes -> the HF field each holds
# (yarn_attn_factor: HF's `attention_factor`, the whole cos/sin scale as transformers reads it).
_GGUF_YARN_FIELDS = {"yarn_attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast",
                     "yarn_beta_slow": "beta_slow"}


def _gguf_yarn_fields(reader: GGUFReader, gguf_arch: str) -> dict:
    """A yarn dict's optional fields, as config.json names them. truncate is never written:
    ggml's yarn truncates (floor / ceil), transformers' default."""
    out: dict[str, Any] = {}
    for key, field in _GGUF_YARN_FIELDS.items():
        value = read_field(reader, f"{gguf_arch}.rope.scaling.{key}", None)
        if value is not None:
            out[field] = float(value)
    # ext_factor weighs the ramp; transformers' yarn has none (always 1.0).
    ext_factor = read_field(reader, f"{gguf_arch}.rope.scaling.yarn_ext_factor", None)
    if ext_factor is not None and float(ext_factor) != 1.0:
        raise ValueError(f"GGUF {gguf_arch}.rope.scaling.yarn_ext_factor {ext_factor} is not "
                         "supported (1.0 only, as transformers' yarn)")
    return out


def _llama3_scaling_from_factors(factors: torch.Tensor, head_dim: int, theta: float) -> dict:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's per-frequency `rope_freqs` tensor.

    llama.cpp stores only the resulting divisors (one per rotary frequency). Any parameters that
    reproduce them give an identical model, so we search the small space Llama 3.x uses.
    """
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
