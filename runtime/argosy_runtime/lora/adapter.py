"""`LoRAAdapter`: a PEFT LoRA adapter folder, laid out for the fused projections.

PEFT saves `adapter_config.json` (r, lora_alpha, ...) and `adapter_model.safetensors` with one
`lora_A` [r, in] and `lora_B` [out, r] per adapted module, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. The model fuses q/k/v and
gate/up into single projections, so each adapted module becomes a slice of a fused output.
Phi-3 checkpoints store those projections fused already (`qkv_proj`, `gate_up_proj`), so its
adapters name them whole: one A and one B over the fused output, applied as a single slice
that spans it (the q/k/v and gate/up orders are the model's own).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from argosy_runtime.lora import hub, s3

if TYPE_CHECKING:
    from argosy_runtime.model_loader import ModelSpec

_MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
# Architectures whose checkpoints (and so their PEFT adapters) name the fused projections.
_STORED_FUSED = ("phi3",)
_FUSED_PARTS = {"qkv_proj": "q_proj, k_proj, v_proj", "gate_up_proj": "gate_proj, up_proj"}
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$")
# LoraConfig's lora_alpha when adapter_config.json has none (PEFT's default, not r: PEFT scales
# such an adapter by 8 / r, and so must we to give its output).
PEFT_DEFAULT_LORA_ALPHA = 8
# init_lora_weights values (prefixes: "pissa_niter_4") whose saved A, B apply to base weights
# the initialisation changed (PEFT: "changes the base weights of the model").
_INITS_CHANGING_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")
# State PEFT saves for variants that differ from plain LoRA in training only (their eval
# forward is B A x): MonteCLoRA's sampler priors, VeLoRA's activation-compression embedding.
_TRAINING_ONLY = re.compile(r"\.lora_(?:monteclora_sampler\.|velora_embed(?:\.|$))")
# Whole (not LoRA) embedding or LM-head weights, as PEFT's save_embedding_layers saves them.
_WHOLE_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|lm_head)\.weight$")
# A multimodal Gemma 3's image encoder and projector (PEFT's target_modules match their
# q_proj/v_proj/... too: `...vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight`).
_VISION = re.compile(r"(?:^|\.)(?:vision_tower|multi_modal_projector)\.")


def _local_folder(path: str) -> Path:
    """The folder `path` names, downloading hf:// and s3:// adapters into the cache first."""
    if hub.is_hub_path(path):
        return hub.download_adapter(path)
    if s3.is_s3_path(path):
        return s3.download_adapter(path)
    return Path(path)


# The weights, in the order PEFT prefers them: older PEFT (and many Hub adapters) saved only
# the pickled adapter_model.bin, which vLLM reads too.
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_files(name: str, path: str, folder: Path) -> tuple[Path, Path]:
    """(adapter_config.json, weights file) of the adapter folder `folder` (`path` as the user
    wrote it); ValueError naming the adapter when one is missing."""
    config_path = folder / "adapter_config.json"
    weights = [folder / f for f in WEIGHTS_FILES if (folder / f).is_file()]
    if config_path.is_file() and weights:
        return config_path, weights[0]
    if not folder.exists() and hub.looks_like_repo_id(path):
        # vLLM downloads a bare org/name from the Hub; here that takes the hf:// scheme.
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a local folder; for a Hugging "
                         f"Face Hub adapter write {hub.SCHEME}{path}")
    raise ValueError(f"LoRA adapter {name!r}: {folder} needs adapter_config.json and "
                     "adapter_model.safetensors (or adapter_model.bin): a PEFT adapter folder")


def _read_weights(name: str, weights_path: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors of `weights_path` (safetensors, or a PyTorch pickle read with
    weights_only, which runs no code) and its bytes; ValueError naming the adapter and the
    file when it cannot be read: an OSError was a 500 for an adapter loaded on first use."""
    try:
        data = weights_path.read_bytes()
    except OSError as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_path}: {exc}") from exc
    if weights_path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            return load(data), data
        except SafetensorError as exc:  # truncated or not safetensors at all
            raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_path}: {exc}") from exc
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (pickle, zip and torch errors alike: not loadable)
        raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_path} as PyTorch "
                         f"weights (torch.load with weights_only): {exc}") from exc
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} does not hold a "
                         "{name: tensor} state dict")
    return tensors, data


@dataclass
class LoRAWeights:
    """One fused projection's adapted modules stacked: A [k * r, in] holds each module's A,
    B [out, k * r] each module's B in its own output rows and rank columns (zeros elsewhere),
    so out += (x A^T) B^T * scale applies them all with two matmuls."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    rank: int  # r; a module of rank_pattern may have another (its A's rows)
    # lora_alpha / r (or / sqrt(r) with use_rslora); a module whose own scale differs
    # (rank_pattern / alpha_pattern) has the ratio folded into its B
    scale: float
    cache_salt: int = 0  # distinct per adapter: its requests' prefix-cache blocks are its own
    # layer index -> fused module name (qkv_proj, o_proj, gate_up_proj, down_proj) -> weights
    layers: dict[int, dict[str, LoRAWeights]] = field(default_factory=dict)
    _decode_layer_tensors: dict[int, list[torch.Tensor]] = field(default_factory=dict, repr=False)

    def decode_layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """A, B of qkv, o, gate_up and down in `layer`, an empty tensor where this adapter
        has none: the per-adapter layout of cpu_ops.decode_layer's `lora` list."""
        if layer not in self._decode_layer_tensors:
            empty = torch.empty(0)
            out = []
            for fused in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                weights = self.layers.get(layer, {}).get(fused)
                out += [empty, empty] if weights is None else [weights.a, weights.b]
            self._decode_layer_tensors[layer] = out
        return self._decode_layer_tensors[layer]

    @classmethod
    def load(cls, name: str, path: str | Path, spec: ModelSpec, dtype: torch.dtype,
             device: torch.device | str = "cpu", max_rank: int | None = None) -> LoRAAdapter:
        """Raises ValueError naming what the adapter has that this server cannot apply.
        `path`: a PEFT adapter folder, `hf://org/name[@revision]` (lora/hub.py) or
        `s3://bucket/prefix` (lora/s3.py). `max_rank`: --max-lora-rank (None: any rank)."""
        try:
            folder = _local_folder(str(path))
        except ValueError as exc:  # hf:// or s3:// download: say which adapter failed
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from exc
        config_path, weights_path = adapter_files(name, str(path), folder)
        config = read_config(name, config_path)
        _check_supported(name, config, max_rank)
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA))
        use_rslora = bool(config.get("use_rslora"))
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        if scale == 0:
            # lora_alpha 0: a module's own scale (alpha_pattern) cannot be folded into its B
            # as a ratio to 0, so the batch applies 1 and every B carries its whole scale.
            scale = 1.0
        rank_pattern = config.get("rank_pattern") or {}
        alpha_pattern = config.get("alpha_pattern") or {}

        tensors, weights = _read_weights(name, weights_path)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        module_keys: dict[tuple[int, str], str] = {}  # PEFT's name of the module (patterns)
        for key, tensor in tensors.items():
            if _VISION.search(key):
                # The server runs a multimodal Gemma 3's text model only (as the base
                # loader skips these tensors), so its image encoder's LoRA never applies.
                # Anywhere else the key would land on the text layer of the same index.
                if spec.architecture == "gemma3":
                    continue
                raise ValueError(f"LoRA adapter {name!r}: cannot apply {key}: an image "
                                 f"encoder's weights; a {spec.architecture} model has none")
            if _TRAINING_ONLY.search(key):
                continue
            match = _KEY.search(key)
            if match is None and spec.is_moe and re.search(r"\.(experts|shared_expert)", key):
                raise ValueError(f"LoRA adapter {name!r}: cannot apply {key}: LoRA on the "
                                 f"Mixture-of-Experts MLP of a {spec.architecture} model is not "
                                 "supported (adapters on the attention projections are)")
            if match is None and _WHOLE_EMBEDDING.search(key) and tensor.dim() == 2:
                # PEFT saves these when the embeddings were resized for added tokens
                # (save_embedding_layers), or trained whole: say so, with the vocabularies.
                vocab = (f"a vocabulary of {tensor.shape[0]} tokens, this model's has "
                         f"{spec.vocab_size}" if tensor.shape[0] != spec.vocab_size
                         else f"{tensor.shape[0]} tokens")
                raise ValueError(f"LoRA adapter {name!r}: cannot apply {key} "
                                 f"{list(tensor.shape)}: the adapter replaces the model's "
                                 f"whole embeddings or LM head ({vocab}; resized for added "
                                 "tokens, or trained with them), which is not supported "
                                 "(only LoRA on the attention and MLP projections)")
            if match is None:
                raise ValueError(f"LoRA adapter {name!r}: cannot apply {key} (only the "
                                 "attention and MLP projections of decoder layers)")
            layer, _, module, which = match.groups()
            pair = pairs.setdefault((int(layer), module), {})
            if which in pair:  # two keys for one weight: which one applies is arbitrary
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lora_{which} "
                                 f"appears twice (again as {key})")
            pair[which] = tensor
            module_keys[(int(layer), module)] = _module_key(key)
        # The salt comes from the files' content: an adapter retrained in place and loaded
        # again must not hit prefix-cache blocks its old weights computed.
        digest = hashlib.sha256(config_path.read_bytes() + weights).digest()
        adapter = cls(name=name, rank=rank, scale=scale,
                      cache_salt=int.from_bytes(digest[:8], "little"))
        layout = _layout(spec)
        fused_out = {}  # fused module -> its output features (the end of its last slice)
        for fused, offset, _, out_size in layout.values():
            fused_out[fused] = max(fused_out.get(fused, 0), offset + out_size)
        stacks: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), ab in sorted(pairs.items()):
            if module in _MLP_MODULES and spec.is_sparse_layer(layer):
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: layer {layer} of "
                                 f"this {spec.architecture} model is a Mixture-of-Experts block; "
                                 "LoRA on its MLP is not supported (adapters on the attention "
                                 "projections are)")
            if module in _FUSED_PARTS and module not in layout:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: a "
                                 f"{spec.architecture} checkpoint names this projection's parts "
                                 f"separately ({_FUSED_PARTS[module]}), so its adapters target "
                                 f"those; only {', '.join(_STORED_FUSED)} adapters name {module}")
            if set(ab) != {"A", "B"} or layer >= spec.num_hidden_layers or module not in layout:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} is incomplete, "
                                 "beyond the model's layers or not a projection it has")
            fused, offset, in_size, out_size = layout[module]
            a, b = ab["A"], ab["B"]
            # PEFT's per-module rank and alpha: the first pattern matching the module's name.
            module_key = module_keys[(layer, module)]
            r = rank_pattern.get(_pattern_key(rank_pattern, module_key), rank)
            module_alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module_key), alpha)
            if (a.dim() != 2 or b.dim() != 2  # before shape[1]: a 1-D tensor has none
                    or a.shape[1] != in_size or b.shape[0] != out_size or a.shape[0] != r
                    or b.shape[1] != r):
                _check_qalora(name, config, layer, module, a, in_size)
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has shapes "
                                 f"A {tuple(a.shape)}, B {tuple(b.shape)}; the model needs "
                                 f"A [{r}, {in_size}], B [{out_size}, {r}]"
                                 + (f" (B spans the whole fused {module}: the rows of "
                                    f"{_FUSED_PARTS[module]} in turn)" if module in _FUSED_PARTS
                                    else "")
                                 + _base_model_hint(config))
            for which, t in (("A", a), ("B", b)):
                # Caught here, not in the first request: integer weights fail its matmul,
                # and NaN or inf ones turn every answer of the adapter into garbage.
                if not t.is_floating_point():
                    raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lora_{which} "
                                     f"is {t.dtype}; LoRA weights are floating point")
                # In float32: isfinite has no float8 kernel (a NotImplementedError, a 500).
                if not torch.isfinite(t.float()).all():
                    raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lora_{which} "
                                     "has values that are not finite (NaN or inf)")
            module_scale = module_alpha / (math.sqrt(r) if use_rslora else r)
            if module_scale != scale:  # the batch applies one scale per adapter
                b = b.float() * (module_scale / scale)
            stacks.setdefault((layer, fused), []).append((offset, a, b))
        for (layer, fused), parts in stacks.items():
            b_stacked = torch.zeros(fused_out[fused], sum(a.shape[0] for _, a, _ in parts))
            col = 0
            for offset, a, b in parts:
                b_stacked[offset : offset + b.shape[0], col : col + a.shape[0]] = b
                col += a.shape[0]
            a_stacked = torch.cat([a for _, a, _ in parts])
            adapter.layers.setdefault(layer, {})[fused] = LoRAWeights(
                a_stacked.to(device=device, dtype=dtype), b_stacked.to(device=device, dtype=dtype))
        if not adapter.layers:
            raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {weights_path}")
        return adapter


def read_config(name: str, config_path: Path) -> dict:
    """`adapter_config.json` as a dict; ValueError naming the adapter if it is not one."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_path}: {exc}") from exc
    except RecursionError as exc:  # json's, on arrays or objects nested thousands deep
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_path}: its JSON is "
                         "nested too deeply") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is not a JSON object")
    return config


def _check_supported(name: str, config: dict, max_rank: int | None = None) -> None:
    unsupported = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        # aLoRA: the adapter applies only from its invocation tokens on; applied to every
        # token it answers differently from the model it was trained as.
        "alora_invocation_tokens": bool(config.get("alora_invocation_tokens")),
        "lora_bias": bool(config.get("lora_bias")),  # a bias on lora_B
        # Variants whose saved A and B alone are not the trained model: KaSA truncates the
        # base weight's smallest singular values and scales B A by learned ones; BD-LoRA's
        # factors are block-diagonal; Arrow routes among several adapters; layer_replication
        # stacks base layers anew; trainable tokens change embedding rows; target_parameters
        # puts LoRA on parameters (MoE experts) we do not adapt. (VeLoRA and MonteCLoRA
        # change training only: served as plain LoRA.)
        **{key: bool(config.get(key)) for key in (
            "kasa_config", "use_bdlora", "arrow_config", "layer_replication",
            "trainable_token_indices", "target_parameters")},
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"LoRA adapter {name!r}: unsupported adapter_config.json setting(s): "
                         f"{', '.join(bad)} (plain LoRA on the attention and MLP projections "
                         "only)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_INITS_CHANGING_BASE):
        # These replace the base weights at initialisation (PiSSA, OLoRA, CorDA, LoRA-GA: W
        # minus their initial B A; LoftQ: a quantized residual); PEFT saves A and B for that changed
        # base and recomputes it when it loads the adapter. Added to the unchanged base they
        # answer differently from the model that was trained, silently: every shape fits.
        raise ValueError(
            f"LoRA adapter {name!r}: adapter_config.json init_lora_weights {init!r}: its "
            "weights apply to base weights this initialisation changed, not to the base "
            "model served; convert it to a plain LoRA with PEFT's save_pretrained(..., "
            "path_initial_model_for_weight_conversion=<the adapter saved before training>)")
    if "r" not in config:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json has no 'r'")
    # Checked here, not where they are used: a bad r or lora_alpha would otherwise fail as
    # a TypeError or ZeroDivisionError (a 500), or pass lazy registration and fail every
    # request naming the adapter.
    rank = config["r"]
    if isinstance(rank, float) and rank.is_integer():  # "r": 8.0 means 8
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json 'r' must be a positive "
                         f"integer, not {config['r']!r}")
    alpha = config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json 'lora_alpha' must be a "
                         f"number, not {alpha!r}")
    _check_patterns(name, config)
    # vLLM's --max-lora-rank, checked on the config so lazy registration refuses it too.
    largest = max([rank, *(config.get("rank_pattern") or {}).values()])
    if max_rank is not None and largest > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {largest} (r or rank_pattern) is above "
                         f"max_lora_rank (--max-lora-rank) {max_rank}; raise it, or leave it "
                         "unset for no limit")


def _base_model_hint(config: dict) -> str:
    """The base model the adapter says it was trained on, for a shape error: an adapter of
    another model (another hidden size) is the usual cause."""
    base = config.get("base_model_name_or_path")
    return f"; it was trained on {base!r}" if isinstance(base, str) and base else ""


def _module_key(key: str) -> str:
    """The module's name as PEFT matched rank_pattern / alpha_pattern against it (the base
    model's module name): the tensor key without PEFT's `base_model.model.` wrapper and
    the `.lora_A.weight` tail."""
    module = key[: key.index(".lora_")]
    return module.removeprefix("base_model.model.")


def _pattern_key(patterns: dict, module_key: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern that matches the end of `module_key` at a
    name boundary (a regex), else `module_key` itself (an exact name, if any)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return pattern
    return module_key


def _check_patterns(name: str, config: dict) -> None:
    """rank_pattern {regex: positive int} and alpha_pattern {regex: number}: refused as a bad
    r or lora_alpha is, naming the setting."""
    checks = (("rank_pattern", "positive integers", lambda v: isinstance(v, int) and v > 0),
              ("alpha_pattern", "numbers",
               lambda v: isinstance(v, int | float) and math.isfinite(v)))
    for setting, wanted, is_valid in checks:
        patterns = config.get(setting)
        if patterns is None:
            continue
        if not isinstance(patterns, dict) or not all(
                is_valid(v) and not isinstance(v, bool) for v in patterns.values()):
            raise ValueError(f"LoRA adapter {name!r}: adapter_config.json {setting!r} must map "
                             f"module name patterns to {wanted}, not {patterns!r}")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"LoRA adapter {name!r}: adapter_config.json {setting} "
                                 f"pattern {pattern!r} is not a regular expression: "
                                 f"{exc}") from exc


def _check_qalora(name: str, config: dict, layer: int, module: str, a: torch.Tensor,
                  in_size: int) -> None:
    """A QA-LoRA adapter (use_qalora) trained on a GPTQ base: PEFT pools the input in groups
    of qalora_group_size before lora_A, so A is [r, in / group]. Said so, rather than as a
    bare shape mismatch. (On a float base PEFT ignores use_qalora: A is [r, in], plain LoRA,
    and such an adapter applies as one.)"""
    group = config.get("qalora_group_size", 16)
    if (config.get("use_qalora") and isinstance(group, int) and group > 1 and a.dim() == 2
            and a.shape[1] * group == in_size):
        raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: a QA-LoRA adapter "
                         f"(use_qalora, lora_A over inputs pooled in groups of {group}: "
                         f"A {tuple(a.shape)}) is not supported; only plain LoRA (A [r, "
                         f"{in_size}]) is")


def _layout(spec: ModelSpec) -> dict[str, tuple[str, int, int, int]]:
    """PEFT module name -> (fused module, output offset, in features, out features). A model
    whose checkpoint stores q/k/v and gate/up fused (Phi-3) takes its adapters on the fused
    names too: the whole projection, offset 0."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    whole = {}
    if spec.architecture in _STORED_FUSED:
        whole = {"qkv_proj": ("qkv_proj", 0, hidden, q + 2 * kv),
                 "gate_up_proj": ("gate_up_proj", 0, hidden, 2 * inter)}
    return whole | {
        "q_proj": ("qkv_proj", 0, hidden, q),
        "k_proj": ("qkv_proj", q, hidden, kv),
        "v_proj": ("qkv_proj", q + kv, hidden, kv),
        "o_proj": ("o_proj", 0, q, hidden),
        "gate_proj": ("gate_up_proj", 0, hidden, inter),
        "up_proj": ("gate_up_proj", inter, hidden, inter),
        "down_proj": ("down_proj", 0, inter, hidden),
    }
