"""Test-side writers of GPTQ / AWQ checkpoints from a random HF model folder.

Written from the formats' descriptions (AutoGPTQ / AutoAWQ packing), independently of the
loader under test; each projection is quantized here with integer zero points and the exact
dequantized weights are kept, so a loaded model can be compared with its reference
(`load_prequantized`, `reference_weights`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.models import LlamaForCausalLM
from argosy_runtime.quantization import QuantizationConfig, load_quantized_weights
from safetensors.torch import load_file, save_file

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R*8, C] -> int32 [R, C]: row 8r + j in bits 4j (GPTQ qweight)."""
    r8, c = q.shape
    v = q.to(torch.int64).view(r8 // 8, 8, c)
    return _to_int32(sum(v[:, j] << (4 * j) for j in range(8)))


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int [R, C*8] -> int32 [R, C]: nibble i holds column 8c + order[i]."""
    r, c8 = q.shape
    v = q.to(torch.int64).view(r, c8 // 8, 8)
    return _to_int32(sum(v[:, :, order[i]] << (4 * i) for i in range(8)))


def quantize_groups(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, min_zero: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q int [K, N], zeros int [ng, N], scales fp16 [ng, N], reference [N, K]."""
    n, k = w.shape
    scales = torch.empty(num_groups, n)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        lo = cols.amin(dim=1).clamp(max=0)
        hi = cols.amax(dim=1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6)
        scales[g] = s
        zeros[g] = torch.round(-lo / s).clamp(min_zero, 15).long()
    scales = scales.half()
    s_k = scales.float()[g_idx].t()  # [N, K]
    z_k = zeros[g_idx].t()
    q = torch.round(w / s_k + z_k).clamp(0, 15).long()
    reference = (q - z_k).float() * s_k
    return q.t().contiguous(), zeros, scales, reference


def write_quantized(src: Path, dst: Path, method: str, group_size: int, *,
                    act_order: bool = False, checkpoint_format: str = "gptq",
                    seed: int = 0) -> tuple[Path, Path]:
    """From the float folder `src`, write `dst` (GPTQ or AWQ) and `dst`-reference (the same
    model with every projection replaced by its exact dequantized weight). Returns both."""
    gen = torch.Generator().manual_seed(seed)
    ref_dir = dst.parent / (dst.name + "-reference")
    for d in (dst, ref_dir):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        proj = module.rsplit(".", 1)[-1]
        if leaf != "weight" or proj not in PROJS:
            out[name] = t
            ref[name] = t
            continue
        w = t.float()
        n, k = w.shape
        ng = -(-k // group_size)
        g_idx = torch.arange(k) // group_size
        if act_order:
            # Same input order for the projections that read the same input (like GPTQ's
            # Hessian-sorted order): one per (layer, input) pair.
            key = module.rsplit(".", 1)[0] + ("/down" if proj == "down_proj" else
                                              "/o" if proj == "o_proj" else "/in")
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            order = orders[key]
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[order] = torch.arange(k) // group_size
        min_zero = 1 if (method == "gptq" and checkpoint_format == "gptq") else 0
        q, zeros, scales, reference = quantize_groups(w, g_idx, ng, min_zero)
        ref[name] = reference.to(t.dtype)
        if method == "gptq":
            stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
            out[f"{module}.qweight"] = pack_rows(q)
            out[f"{module}.qzeros"] = pack_cols(stored_zeros)
            out[f"{module}.scales"] = scales
            out[f"{module}.g_idx"] = g_idx.to(torch.int32)
            if proj in ("o_proj", "down_proj"):
                out[f"{module}.bias"] = torch.zeros(n, dtype=torch.float16)  # AutoGPTQ writes these
        else:
            out[f"{module}.qweight"] = pack_cols(q, AWQ_ORDER)
            out[f"{module}.qzeros"] = pack_cols(zeros, AWQ_ORDER)
            out[f"{module}.scales"] = scales
    save_file(out, str(dst / "model.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
              "sym": False, "checkpoint_format": checkpoint_format}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm"}
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, ref_dir


def load_prequantized(folder: Path, config: QuantizationConfig | None = None
                      ) -> LlamaForCausalLM:
    """The model of a quantized folder, in float32, loaded by the loader under test."""
    ckpt = load_checkpoint(str(folder))
    model = LlamaForCausalLM(ckpt.spec, torch.float32)
    load_quantized_weights(model, ckpt, config)
    return model


def reference_weights(ref_dir: Path) -> dict[str, torch.Tensor]:
    """The float32 parameters of a reference (dequantized) folder, by name."""
    ckpt = load_checkpoint(str(ref_dir))
    model = LlamaForCausalLM(ckpt.spec, torch.float32)
    model.check_all_loaded(model.load_weights(ckpt.iter_weights()))
    return dict(model.named_parameters())
