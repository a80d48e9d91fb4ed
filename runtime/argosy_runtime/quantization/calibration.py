"""Calibration for GPTQ: a small text sample and a layer-by-layer dense forward.

The sample is built at run time from docstrings of standard-library modules (present
wherever Python is, English prose about software). `CALIBRATION_MODULES` is kept disjoint
from the modules the quality tests measure perplexity on.

`calibrate_and_quantize` runs the calibration tokens through the model one decoder layer at
a time (plain causal attention over whole sequences, no KV cache), collects X^T X at the
input of each linear to quantize, quantizes that layer with GPTQ, then feeds the *quantized*
layer's outputs to the next layer (sequential GPTQ, as AutoGPTQ does).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("argosy.quantization")

CALIBRATION_MODULES = ("os", "re", "subprocess", "threading", "asyncio", "datetime",
                       "decimal", "pathlib", "shutil", "socket", "tempfile", "unittest")


def calibration_text(max_chars: int = 40_000) -> str:
    """Docstrings (>= 200 chars) of CALIBRATION_MODULES and their public callables."""
    parts: list[str] = []
    for name in CALIBRATION_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 200:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)[:max_chars]


def calibration_batch(tokenizer, num_sequences: int = 4, seq_len: int = 256) -> torch.Tensor:
    """int64 [num_sequences, seq_len] token ids cut from `calibration_text`."""
    ids = tokenizer.encode(calibration_text(), add_special_tokens=False)
    need = num_sequences * seq_len
    if len(ids) < need:
        ids = (ids * (need // max(len(ids), 1) + 1))
    return torch.tensor(ids[:need]).view(num_sequences, seq_len)


_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
            ("mlp", "down_proj"))


def _layer_forward(model: nn.Module, layer: nn.Module, h: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """One decoder layer on h [B, T, hidden] with full causal attention."""
    b, t, _ = h.shape
    attn = layer.self_attn
    x = layer.input_layernorm(h).reshape(b * t, -1)
    qk, v = attn.qkv_proj(x).split([attn.q_size + attn.kv_size, attn.kv_size], dim=-1)
    qk = qk.reshape(b * t, attn.num_heads + attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:  # Qwen3: q/k heads RMS-normalized before the rotary, as in Attention
        qk = attn._norm_heads(qk)
    q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)
    q, k = model.rotary(positions, q, k)
    rep = attn.num_heads // attn.num_kv_heads
    q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
    v = v.reshape(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, hd]
    o = attn.o_proj(o.transpose(1, 2).reshape(b * t, attn.q_size)).view(b, t, -1)
    h = h + o
    return h + layer.mlp(layer.post_attention_layernorm(h))


@torch.no_grad()
def calibrate_and_quantize(model: nn.Module, input_ids: torch.Tensor,
                           quantize: Callable[[str, nn.Linear, torch.Tensor], nn.Module]) -> None:
    """Replace every decoder linear with `quantize(name, linear, hessian)`, layer by layer."""
    b, t = input_ids.shape
    positions = torch.arange(t).repeat(b)
    h = model.model.embed_tokens(input_ids)  # [B, T, hidden]
    for i, layer in enumerate(model.model.layers):
        hessians: dict[str, torch.Tensor] = {}
        hooks = []
        for parent, child in _LINEARS:
            module = getattr(getattr(layer, parent), child)

            def hook(_mod: nn.Module, args: tuple, key: str = f"{parent}.{child}",
                     acc: dict[str, torch.Tensor] = hessians) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                acc[key] = acc.get(key, 0) + x.t() @ x

            hooks.append(module.register_forward_pre_hook(hook))
        _layer_forward(model, layer, h, positions)
        for hook_handle in hooks:
            hook_handle.remove()
        for parent, child in _LINEARS:
            owner = getattr(layer, parent)
            name = f"model.layers.{i}.{parent}.{child}"
            setattr(owner, child, quantize(name, getattr(owner, child), hessians[f"{parent}.{child}"]))
        h = _layer_forward(model, layer, h, positions)  # inputs of the next layer, quantized
    logger.info("GPTQ calibration on %d x %d tokens done", b, t)
