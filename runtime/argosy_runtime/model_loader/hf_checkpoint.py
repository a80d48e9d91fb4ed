"""Hugging Face model folders: config.json + one or many safetensors files."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from argosy_runtime.model_loader import lm_head_classifier
from argosy_runtime.model_loader.model_spec import ModelSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
logger = logging.getLogger("argosy.model_loader")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# Buffers some older checkpoints saved that are recomputed by the model, not weights
# (cos/sin caches: models trained with ColossalAI, which vLLM's Llama loader skips too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file holding an object, raising FileNotFoundError / ValueError that name
    the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in model folder {path.parent}")
    try:
        with path.open(encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):  # every caller reads fields: a list would fail as .get
        raise ValueError(f"{path} is not a JSON object (got a {type(value).__name__})")
    return value


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """safe_open(file), its SafetensorError (a truncated or corrupt file, not a ValueError)
    turned into a ValueError naming the file."""
    try:
        handle = safe_open(str(file), framework="pt")
    except SafetensorError as exc:
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    with handle as f:
        yield f


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: the shards listed by the index, or model.safetensors."""
    index = folder / INDEX_FILE
    weight_map: dict[str, str] = {}
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
        if not weight_map:
            raise ValueError(f"{index} has an empty weight_map")
        for name in weight_map.values():
            # Shards sit beside the index: a path ("../x", "/x") would load weights from
            # outside the model folder.
            if not name or Path(name).name != name or name in (".", ".."):
                raise ValueError(f"{index}: shard {name!r} is not a file name in the model "
                                 "folder")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in model folder "
                                f"{folder}{_weights_hint(folder)}")
    for file in files:
        if not file.is_file():
            listed = [tensor for tensor, shard in weight_map.items() if shard == file.name]
            raise FileNotFoundError(
                f"weight shard {file.name} listed in {INDEX_FILE} is missing from {folder}: "
                f"it holds {len(listed)} tensor(s), e.g. {', '.join(listed[:3])}")
    return files


def _weights_hint(folder: Path) -> str:
    """What the folder holds instead of safetensors weights, and what to do about it."""
    def named(*suffixes: str) -> list[str]:
        return sorted(p.name for p in folder.iterdir()
                      if p.is_file() and p.suffix.lower() in suffixes)

    hints = []
    if pickles := named(".bin", ".pt", ".pth"):
        hints.append(f"found {', '.join(pickles)}: only safetensors is supported")
    if shards := named(".safetensors"):  # e.g. shards whose index was not downloaded
        hints.append(f"found {', '.join(shards)} without {INDEX_FILE} naming its tensors")
    if ggufs := named(".gguf"):  # GGUF repos often carry a config.json too
        hints.append(f"found {', '.join(ggufs)}: pass the .gguf file itself")
    return f" ({'; '.join(hints)})" if hints else ""


def checkpoint_dtype(files: list[Path]) -> str:
    """The dtype of the floating point weights ("float32" | "bfloat16" | "float16")."""
    with open_safetensors(files[0]) as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            if dtype in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[dtype]
    raise ValueError(f"{files[0]} holds no float32/bfloat16/float16 tensor")


def load_hf_spec(folder: Path, files: list[Path],
                 hf_overrides: dict[str, Any] | None = None) -> ModelSpec:
    """ModelSpec from config.json (+ generation_config.json), dtype from the weight files.
    `hf_overrides` replaces config.json's top-level fields (vLLM's --hf-overrides: a nested
    object such as rope_scaling is replaced whole, not merged). A causal LM asked to be a
    classifier made of its lm_head rows (`classifier_from_token`, Qwen3-Reranker) comes back
    as that classifier (lm_head_classifier.py)."""
    file_config = read_json(folder / "config.json")
    config = {**file_config, **(hf_overrides or {})}
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    spec = ModelSpec.from_hf_config(
        config, checkpoint_dtype=checkpoint_dtype(files), generation_config=generation
    )
    if spec.tie_word_embeddings and _stores_distinct_lm_head(files):
        # transformers ties only what the checkpoint does not contradict: an lm_head.weight
        # stored beside the embeddings with other values is served as it is ("both are
        # present in the checkpoints with different values, so we will NOT tie them").
        # Tying it here would silently serve another model.
        logger.warning("config.json says tie_word_embeddings but the checkpoint stores an "
                       "lm_head.weight that differs from the embeddings: serving it untied, "
                       "as transformers does")
        spec = dataclasses.replace(spec, tie_word_embeddings=False)
    return lm_head_classifier.convert_spec(spec, config, file_config)


def _stores_distinct_lm_head(files: list[Path]) -> bool:
    """Whether the checkpoint stores an lm_head.weight that is not exactly the embeddings
    (transformers' torch.equal test; a tied checkpoint usually stores no lm_head at all)."""
    found: dict[str, tuple[Path, str]] = {}
    for file in files:
        with open_safetensors(file) as f:
            for stored in f.keys():
                name = model_weight_name(stored)
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    found[name] = (file, stored)
    if len(found) < 2:
        return False
    tensors = []
    for file, stored in found.values():
        with open_safetensors(file) as f:
            tensors.append(f.get_tensor(stored))
    return not torch.equal(*tensors)


def expected_weight_names(spec: ModelSpec) -> list[str]:
    """Every HF parameter name the model forward consumes, in model order."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if spec.is_gemma:  # norms before and after the MLP as well
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ("q", "k", "v", "o"):
            names.append(f"{p}self_attn.{proj}_proj.weight")
            if spec.attention_bias and proj != "o":
                names.append(f"{p}self_attn.{proj}_proj.bias")
        names += _mlp_weight_names(spec, i)
    names.append("model.norm.weight")
    if spec.has_lm_head and not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    if spec.classifier_method:  # a head made of lm_head rows: read the lm_head (or tied embedding)
        if lm_head_classifier.source_weight(spec) not in names:
            names.append(lm_head_classifier.source_weight(spec))
    elif spec.num_labels:
        names.append("score.weight")  # the classification head: [num_labels, hidden]
    return names


# Mixtral's Hub names of an expert's projections.
_MIXTRAL_EXPERT_WEIGHTS = {"gate": "w1", "up": "w3", "down": "w2"}


def moe_router_name(spec: ModelSpec, layer: int) -> str:
    """The published name of an MoE layer's router: Mixtral `block_sparse_moe.gate`, Qwen MoE
    `mlp.gate`."""
    block = "block_sparse_moe" if spec.architecture == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def expert_weight_name(spec: ModelSpec, layer: int, expert: int, proj: str) -> str:
    """The published name of expert `expert`'s `proj` ("gate", "up" or "down") weight in layer
    `layer`: Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen MoE
    `mlp.experts.{e}.gate_proj/up_proj/down_proj`. Every expert layout (transformers' fused
    tensors, GGUF's merged ones) is read into these names."""
    if spec.architecture == "mixtral":
        return (f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
                f"{_MIXTRAL_EXPERT_WEIGHTS[proj]}.weight")
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def _mlp_weight_names(spec: ModelSpec, layer: int) -> list[str]:
    """Layer `layer`'s MLP weights: the dense MLP's, or an MoE layer's in the per-expert
    layout published checkpoints use (and transformers' save_pretrained writes by default):
    Mixtral `block_sparse_moe.gate` + `experts.{e}.w1/w2/w3`, Qwen MoE `mlp.gate` +
    `experts.{e}.gate_proj/up_proj/down_proj` (+ Qwen2-MoE's `shared_expert.*` and
    `shared_expert_gate`)."""
    p = f"model.layers.{layer}."
    if not spec.is_sparse_layer(layer):
        return [f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    names = [moe_router_name(spec, layer)] + [expert_weight_name(spec, layer, e, proj)
                                              for e in range(spec.num_experts)
                                              for proj in ("gate", "up", "down")]
    if spec.shared_expert_intermediate_size:
        names += [f"{p}mlp.shared_expert.{proj}_proj.weight" for proj in ("gate", "up", "down")]
        names.append(p + "mlp.shared_expert_gate.weight")
    return names


_FUSED_EXPERTS = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.(?:gate_up_proj|down_proj)(?:\.weight)?)$")


def split_fused_experts(name: str, tensor: torch.Tensor, spec: ModelSpec
                        ) -> list[tuple[str, torch.Tensor]] | None:
    """transformers 5's in-memory MoE layout (what `save_pretrained(save_original_format=False)`
    writes) in the per-expert names of `_mlp_weight_names`, or None for any other tensor.

    `mlp.experts.gate_up_proj` [experts, 2 * moe_intermediate, hidden] holds each expert's gate
    rows then its up rows; `mlp.experts.down_proj` [experts, hidden, moe_intermediate]; a
    Mixtral router saved as `mlp.gate.weight` is `block_sparse_moe.gate.weight`."""
    match = _FUSED_EXPERTS.match(name)
    if match is None or not spec.is_sparse_layer(int(match.group(1))):
        return None
    layer, what = int(match.group(1)), match.group(2)
    if what == "gate.weight":
        return [(moe_router_name(spec, layer), tensor)] if spec.architecture == "mixtral" else None
    inter, hidden, num = spec.moe_intermediate_size, spec.hidden_size, spec.num_experts
    gate_up = what.startswith("experts.gate_up_proj")
    expected = (num, 2 * inter, hidden) if gate_up else (num, hidden, inter)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                         f"model {expected} (experts, out, in)")
    out = []
    for e in range(num):
        if gate_up:
            out.append((expert_weight_name(spec, layer, e, "gate"), tensor[e, :inter]))
            out.append((expert_weight_name(spec, layer, e, "up"), tensor[e, inter:]))
        else:
            out.append((expert_weight_name(spec, layer, e, "down"), tensor[e]))
    return out


_PHI3_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)$")


def phi3_fused_parts(module: str, spec: ModelSpec) -> tuple[list[str], list[int]] | None:
    """The per-projection modules a Phi-3 fused module holds, in row order, and their output
    sizes, or None for any other module name: `model.layers.N.self_attn.qkv_proj` -> q, k, v
    (transformers' Phi3Attention slices its rows so), `model.layers.N.mlp.gate_up_proj` ->
    gate, up (Phi3MLP's chunk(2)). Shared by the float split below and the GPTQ/AWQ one
    (quantization/prequantized.py), so both cut at the same places."""
    match = _PHI3_FUSED.match(module)
    if match is None:
        return None
    prefix, fused = match.groups()
    if fused == "self_attn.qkv_proj":
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        return [f"{prefix}self_attn.{p}_proj" for p in ("q", "k", "v")], [q, kv, kv]
    return [f"{prefix}mlp.gate_proj", f"{prefix}mlp.up_proj"], [spec.intermediate_size] * 2


def split_phi3_fused(name: str, tensor: torch.Tensor, spec: ModelSpec
                     ) -> list[tuple[str, torch.Tensor]] | None:
    """Phi-3's stored fused projections in the per-projection names of `expected_weight_names`
    (views, no copy; the model fuses them again), or None for any other tensor.

    `self_attn.qkv_proj.weight` [(heads + 2 kv_heads) * head_dim, hidden] holds the q rows,
    then k, then v; `mlp.gate_up_proj.weight` [2 * intermediate, hidden] the gate rows then
    the up rows (`phi3_fused_parts`)."""
    module, _, leaf = name.rpartition(".")
    fused = phi3_fused_parts(module, spec) if leaf == "weight" else None
    if fused is None:
        return None
    parts, sizes = fused
    if tuple(tensor.shape) != (sum(sizes), spec.hidden_size):
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                         f"model {(sum(sizes), spec.hidden_size)}")
    return [(f"{part}.weight", rows) for part, rows in zip(parts, tensor.split(sizes, dim=0))]


_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."))
# A multimodal Gemma 3's image encoder and projector, in either naming: not served.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def model_weight_name(stored_name: str) -> str:
    """The name the model expects for a tensor as stored: a headless checkpoint (`LlamaModel`,
    `MistralModel`, `Qwen2Model`) saves the decoder's own names, without the `model.` prefix
    a `*ForCausalLM` puts in front of them (`layers.0.mlp.up_proj.weight`). The text model of a
    multimodal checkpoint (Gemma3ForConditionalGeneration) is stored as
    `language_model.model.*` + `language_model.lm_head.*` (the Hub's, and what transformers 5
    saves) or `model.language_model.*` + `lm_head.*` (transformers' in-memory names)."""
    for prefix, ours in _TEXT_MODEL_PREFIXES:
        if stored_name.startswith(prefix):
            return ours + stored_name[len(prefix):]
    if stored_name.startswith(("model.", "lm_head.", "score.")):
        return stored_name
    return "model." + stored_name


def _float_tensor(f: Any, file: Path, stored: str) -> torch.Tensor:
    """Tensor `stored` of the open file `f`: a weight must be floating point, as copying an
    integer or bool tensor into a float parameter would load garbage without an error."""
    tensor = f.get_tensor(stored)
    if not tensor.is_floating_point():
        raise ValueError(f"{file.name}: tensor {stored!r} is {tensor.dtype}, not a floating "
                         "point weight")
    return tensor


def iter_hf_weights(files: list[Path], spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each model weight, in checkpoint dtype, file by file, named as the
    model expects (`model_weight_name`) whether or not the file has the `model.` prefix.

    Raises ValueError for a tensor the architecture does not have, and, at the end, for any
    weight that never appeared (a truncated or mismatched checkpoint).
    """
    expected = set(expected_weight_names(spec))
    seen: set[str] = set()
    num_vision = 0
    for file in files:
        with open_safetensors(file) as f:
            for stored in f.keys():
                if stored.endswith(_IGNORED_SUFFIXES):
                    continue
                if spec.architecture == "gemma3" and stored.startswith(_VISION_PREFIXES):
                    num_vision += 1
                    continue
                name = model_weight_name(stored)
                if name == "lm_head.weight" and spec.tie_word_embeddings:
                    continue  # tied: the forward reuses embed_tokens
                if (spec.is_moe or spec.architecture == "phi3") and name not in expected:
                    split = split_fused_experts if spec.is_moe else split_phi3_fused
                    tensors = split(name, _float_tensor(f, file, stored), spec)
                    if tensors is not None:  # fused experts (transformers 5) / Phi-3, split
                        for split_name, tensor in tensors:
                            if split_name in seen:
                                raise ValueError(f"{file.name}: tensor {split_name!r} appears "
                                                 f"twice (also in {stored!r})")
                            seen.add(split_name)
                            yield split_name, tensor
                        continue
                if name not in expected:
                    what = ("a " if spec.has_lm_head else
                            "a sequence-classification " if spec.num_labels else
                            "a headless (no lm_head) ")
                    raise ValueError(f"{file.name}: unexpected tensor {stored!r} for "
                                     f"{what}{spec.architecture} model")
                if name in seen:  # both `x` and `model.x`: which one would win is arbitrary
                    raise ValueError(f"{file.name}: tensor {stored!r} appears twice "
                                     f"(as {name!r} too)")
                seen.add(name)
                yield name, _float_tensor(f, file, stored)
    if num_vision:
        logger.info("%s: serving the text model only; skipped %d vision tower / projector "
                    "tensors", spec.architecture, num_vision)
    missing = expected - seen
    if missing:
        headless = not spec.has_lm_head and not spec.num_labels
        note = " (a headless checkpoint may store them without 'model.')" if headless else ""
        if spec.classifier_method and lm_head_classifier.LM_HEAD in missing:
            note = (" (classifier_from_token reads the lm_head: a checkpoint that ties it to "
                    "the embeddings says tie_word_embeddings: true)")
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}{note}")
