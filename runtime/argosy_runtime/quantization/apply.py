"""`load_quantized_weights`: load a checkpoint into a model, decoder linears quantized.

The engine calls this instead of `model.load_weights` when `quantization` is set or the
checkpoint is pre-quantized. Weights stream one tensor at a time: each projection is
quantized as it arrives (both formats are row-wise, so quantizing q/k/v separately and
stacking the rows equals quantizing the fused qkv matrix), and every other weight goes
straight to `model.load_weights`. Then the lm_head becomes int8 per output channel (in both
modes: at batch 1 its 49152 x 576 bfloat16 matrix was the largest single read of SmolLM2's
int4 decode step), and an embedding tied to it reads its rows from that int8 table. A
headless model (no lm_head: an embedding checkpoint) skips that last part.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from argosy_runtime.quantization.config import QuantizationConfig
from argosy_runtime.quantization.footprint import weight_bytes
from argosy_runtime.quantization.gguf_quant import INT4_GGUF_TYPES, permute_rows, q4_to_int4
from argosy_runtime.quantization.int4_linear import Int4Linear
from argosy_runtime.quantization.int8_embedding import Int8Embedding
from argosy_runtime.quantization.int8_linear import Int8Linear
from argosy_runtime.quantization.prequantized import detect_prequantized, iter_prequantized
from argosy_runtime.quantization.rtn import Int4Weight, Int8Weight, quantize_int4, quantize_int8

logger = logging.getLogger("argosy.quantization")

# Fused module names (in model.layers.*) that are quantized.
QUANTIZED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
QuantItem = torch.Tensor | Int8Weight | Int4Weight

__all__ = ["QUANTIZED_MODULES", "detect_prequantized", "load_quantized_weights"]


def load_quantized_weights(model: nn.Module, checkpoint: Any,
                           config: QuantizationConfig | None) -> None:
    """Load every weight of `checkpoint` into `model`, with quantized decoder linears.

    `config` None means: use the checkpoint's own quantization (GPTQ/AWQ). A pre-quantized
    checkpoint must be given no config or one with the same method (its group size wins).
    Raises ValueError on a mismatching or incomplete checkpoint.
    """
    pre = detect_prequantized(checkpoint)
    spec = getattr(model, "spec", None)
    moe = spec is not None and spec.is_moe
    if pre is not None and moe:
        raise ValueError(f"pre-quantized ({pre.describe()}) {spec.architecture} checkpoints are "
                         "not supported: Mixture-of-Experts models load from float weights "
                         "(quantization='int8' / 'int4' quantizes their experts at load)")
    if pre is not None:
        if config is not None and config.method != pre.method:
            raise ValueError(f"quantization={config.method!r} was asked for, but the checkpoint is "
                             f"pre-quantized as {pre.describe()}")
        config = pre
    if config is None:
        raise ValueError("load_quantized_weights needs a QuantizationConfig for a checkpoint "
                         "that is not pre-quantized")
    dtype = model.model.embed_tokens.weight.dtype
    before = weight_bytes(model)
    if config.algorithm == "gptq" and config.source == "rtn":
        if moe:
            raise ValueError(f"GPTQ calibration does not support Mixture-of-Experts models "
                             f"({spec.architecture}); use round-to-nearest int8 / int4")
        # Calibration runs Llama's plain layer: not Gemma's, and it would rotate SmolLM3's
        # NoPE layers and skip Granite's multipliers.
        if spec is not None and (spec.is_gemma or spec.nope_layers
                                 or spec.architecture == "granite"):
            raise ValueError(f"GPTQ calibration does not support {spec.architecture} (its "
                             "calibration forward is Llama's layer); use round-to-nearest "
                             "int8 / int4")
        _load_with_gptq(model, checkpoint, config, dtype)
        quantize_output_layer(model)
        logger.info("quantized decoder linears to %s with GPTQ%s: weights %.1f MiB -> %.1f MiB",
                    config.describe(), _head_note(model), before / 2**20, weight_bytes(model) / 2**20)
        return
    pending: dict[str, dict[int, Int8Weight | Int4Weight]] = {}

    def unquantized() -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, item in _iter_source(checkpoint, config):
            name, shard = model.map_weight_name(hf_name)
            module_name, _, leaf = name.rpartition(".")
            if leaf == "weight" and _is_quantized_module(module_name):
                shards = pending.setdefault(module_name, {})
                shards[shard or 0] = _quantize(item, config)
                continue
            if not isinstance(item, torch.Tensor):  # a quantized tensor we keep in float
                item = item.dequantize()
            yield hf_name, item

    loaded = model.load_weights(unquantized())
    # Checked while the quantized modules are still nn.Linears, whose biases are parameters
    # (an Int4Linear's bias is a buffer: a missing one would stay uninitialized memory); their
    # weights arrived in `pending`.
    model.check_all_loaded(loaded | _pending_names(pending))
    for module_name, module in list(model.named_modules()):
        if not _is_quantized_module(module_name):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{module_name} is not an nn.Linear (already quantized?)")
        shards = pending.pop(module_name)
        quantized = _build_module(module_name, [shards[i] for i in sorted(shards)], module,
                                  config, dtype)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, quantized)
    quantize_output_layer(model)
    logger.info("quantized decoder linears to %s%s: weights %.1f MiB -> %.1f MiB",
                config.describe(), _head_note(model), before / 2**20, weight_bytes(model) / 2**20)


def _pending_names(pending: dict[str, dict[int, Int8Weight | Int4Weight]]) -> set[str]:
    """The names `check_all_loaded` expects for the quantized weights held in `pending`."""
    names: set[str] = set()
    for module_name, shards in pending.items():
        fused = module_name.rsplit(".", 1)[-1] in ("qkv_proj", "gate_up_proj")
        names.update(f"{module_name}.weight#{i}" if fused else f"{module_name}.weight"
                     for i in shards)
    return names


def _head_note(model: nn.Module) -> str:
    return ", lm_head to int8" if model.lm_head is not None else " (no lm_head: headless)"


def quantize_output_layer(model: nn.Module) -> None:
    """lm_head -> Int8Linear (per output channel); a tied embedding -> Int8Embedding on it.
    A headless model (no lm_head) keeps its embedding as it is."""
    head = model.lm_head
    if head is None:
        return
    if not isinstance(head, nn.Linear):
        raise ValueError(f"lm_head is a {type(head).__name__}, not an nn.Linear (already quantized?)")
    tied = head.weight is model.model.embed_tokens.weight
    model.lm_head = Int8Linear.from_linear(head)
    if tied:
        model.model.embed_tokens = Int8Embedding(model.lm_head)


def _load_with_gptq(model: nn.Module, checkpoint: Any, config: QuantizationConfig,
                    dtype: torch.dtype) -> None:
    """Load in float, then quantize layer by layer on calibration activations."""
    from argosy_runtime.quantization.calibration import calibrate_and_quantize, calibration_batch
    from argosy_runtime.quantization.gptq_quantizer import gptq_quantize_int4

    model.check_all_loaded(model.load_weights(checkpoint.iter_weights()))

    def quantize(name: str, linear: nn.Linear, hessian: torch.Tensor) -> nn.Module:
        weight = gptq_quantize_int4(linear.weight.detach(), hessian, config.group_size)
        bias = linear.bias.detach() if linear.bias is not None else None
        return Int4Linear.from_weight(weight, bias, dtype=dtype)

    calibrate_and_quantize(model, calibration_batch(checkpoint.tokenizer), quantize)


def _is_quantized_module(module_name: str) -> bool:
    return module_name.startswith("model.layers.") and module_name.rsplit(".", 1)[-1] in QUANTIZED_MODULES


def _iter_source(checkpoint: Any, config: QuantizationConfig) -> Iterator[tuple[str, QuantItem]]:
    if config.source in ("gptq", "awq"):
        yield from iter_prequantized(checkpoint, config)
    elif checkpoint.format == "gguf":
        yield from _iter_gguf(checkpoint, config)
    else:
        yield from checkpoint.iter_weights()


def _iter_gguf(checkpoint: Any, config: QuantizationConfig) -> Iterator[tuple[str, QuantItem]]:
    """Raw GGUF tensors: Q4_0/Q4_1 projections kept as int4-g32 when the target is int4 (see
    QuantizationConfig.keep_gguf_blocks), everything else dequantized (rope row permutation
    undone either way)."""
    from argosy_runtime.model_loader.gguf_checkpoint import dequantize_tensor, undo_rope_permutation

    keep = config.method == "int4" and (config.keep_gguf_blocks or config.group_size == 32)
    if keep and config.group_size != 32:
        logger.info("keeping the GGUF file's 4-bit blocks as int4 group 32 (asked: group %d); "
                    "keep_gguf_blocks=False re-quantizes them", config.group_size)
    for hf_name, tensor in checkpoint.iter_raw_gguf_tensors():
        if isinstance(tensor, torch.Tensor):  # split / shifted on reading: already float32
            yield hf_name, tensor
            continue
        heads = checkpoint.gguf_rope_heads(hf_name)
        if keep and tensor.tensor_type in INT4_GGUF_TYPES and hf_name.endswith("_proj.weight"):
            weight = q4_to_int4(tensor)
            if heads is not None:
                rows = undo_rope_permutation(torch.arange(weight.q.shape[0]), heads)
                weight = permute_rows(weight, rows)
            yield hf_name, weight
        else:
            yield hf_name, dequantize_tensor(tensor, heads)


def _quantize(item: QuantItem, config: QuantizationConfig) -> Int8Weight | Int4Weight:
    if isinstance(item, torch.Tensor):
        if item.dim() != 2:
            raise ValueError(f"expected a 2-D projection weight, got shape {tuple(item.shape)}")
        if config.method == "int8":
            return quantize_int8(item)
        return quantize_int4(item, config.group_size, config.clip_search)
    if config.method == "int8" and isinstance(item, Int4Weight):
        return quantize_int8(item.dequantize())
    if config.method == "int4" and isinstance(item, Int8Weight):
        return quantize_int4(item.dequantize(), config.group_size, config.clip_search)
    return item


def _build_module(name: str, shards: list[Int8Weight | Int4Weight], original: nn.Linear,
                  config: QuantizationConfig, dtype: torch.dtype) -> nn.Module:
    """Stack the shards' rows (q; k; v or gate; up) into one quantized module."""
    bias = original.bias.detach() if original.bias is not None else None
    expected = (original.out_features, original.in_features)
    if isinstance(shards[0], Int8Weight):
        weight = Int8Weight(torch.cat([s.q for s in shards]), torch.cat([s.scale for s in shards]))
        _check_shape(name, tuple(weight.q.shape), expected)
        return Int8Linear.from_weight(weight, bias, dtype=dtype)
    perms = [s.input_perm for s in shards]
    groups = {(s.group_size, s.in_features) for s in shards}
    same_perm = all(p is None for p in perms) or all(
        p is not None and torch.equal(p, perms[0]) for p in perms)
    if len(groups) != 1 or not same_perm:
        # Shards that cannot share one input order (act-order GPTQ with different orders):
        # re-quantize them in natural order rather than fail.
        logger.warning("%s: shards differ in group layout; re-quantizing them", name)
        shards = [quantize_int4(s.dequantize(), config.group_size, config.clip_search)
                  for s in shards]
    first = shards[0]
    weight = Int4Weight(torch.cat([s.q for s in shards]), torch.cat([s.scales for s in shards]),
                        torch.cat([s.zeros for s in shards]), first.group_size, first.in_features,
                        first.input_perm)
    _check_shape(name, (weight.q.shape[0], weight.in_features), expected)
    return Int4Linear.from_weight(weight, bias, dtype=dtype)


def _check_shape(name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if actual != expected:
        raise ValueError(f"quantized weight of {name} has shape {actual}, the model expects {expected}")
