"""`CpuDecodeLayers`: a decode step's decoder layers as one C++ call each (CPU, bfloat16).

At batch 1 a small model's decode step on the CPU spends about as long in Python, between the
~17 op calls and 8 module calls of every layer, as in the ops themselves (SmolLM2-135M int4:
~3 of ~10 ms). `cpu_ops.decode_layer` runs the same fused kernels in the same order from C++
(argosy_kernels/csrc/cpu_ops.cpp), so the outputs are the Python path's, token for token
(tests/runtime/engine/test_cpu_decode_layers.py). It is used for steps whose tokens are all
decodes (in the batch-invariant mode: any step of up to MAX_TOKENS rows), when every layer
runs the fused CPU ops and every linear has a C++ path; any other step, layer or model takes
the module path. Qwen3's per-head q/k norms run inside the C++ layer too (rms_norm_rows on each
head, in place in the qkv output, before the rotary), and each layer's sliding window (Mistral,
windowed Qwen2 layers) goes to its attention as on the module path. SmolLM3's NoPE layers
(no rotary on the module path) get the identity rotation, cos 1 and sin 0: x * 1 + x' * 0 is
x exactly, so they keep the module path's bits. Granite's layers scale their residual branches,
which decode_layer cannot: DecoderLayer turns `cpu_decode_layer` off for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from argosy_runtime.models.cpu_linear import PackedLinear
from argosy_runtime.quantization.int4_linear import Int4Linear
from argosy_runtime.quantization.int8_linear import Int8Linear

if TYPE_CHECKING:
    from argosy_runtime.models.llama import ForwardContext, LlamaModel

# Linear kinds, as cpu_ops.cpp's apply_linear numbers them.
_PACKED_BF16, _INT4, _INT8 = 0, 1, 2


def _linear_args(module: nn.Module) -> tuple[list[torch.Tensor], int, int] | None:
    """(tensors, kind, param) of a linear with a C++ path, else None."""
    if isinstance(module, PackedLinear):
        bias = [] if module.bias is None else [module.bias]
        return [module.packed_weight, *bias], _PACKED_BF16, len(bias)
    if isinstance(module, Int4Linear) and module._plain_cpu_ops:
        return [module.qweight, module.scales_and_zeros], _INT4, module.group_size
    if isinstance(module, Int8Linear) and module.bias is None and module.qweight.device.type == "cpu":
        return [module.qweight, module.scales], _INT8, module.packed_max_tokens
    return None


class CpuDecodeLayers:
    # decode_layer calls the int4 kernel for every row count, where Int4Linear stops at its
    # packed_max_tokens (2048) and dequantizes; decode batches stay far below both.
    MAX_TOKENS = 256
    # Chunks of up to this many tokens (a speculative step's 1 + k tokens, a draft catching
    # up on one or two) run as decode rows (attention/batch.py), so their steps take this
    # path too. Each row reads its own context, so long chunks stay on the prefill kernel,
    # which reads a chunk's context once.
    CHUNK_AS_DECODE_ROWS = 8

    def __init__(self, layer_args: list[tuple], eps: float, num_heads: int, num_kv_heads: int
                 ) -> None:
        self.layer_args = layer_args
        self.eps = eps
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        # Per layer, whether it rotates q and k (False: SmolLM3's NoPE layers). Set by build.
        self.rope_layers = [True] * len(layer_args)
        # Set by LlamaForCausalLM.use_batch_invariant_kernels: every row of a step is then a
        # chunk row (no decode rows), and decode_layer runs varlen_attention and the linears'
        # row-count-independent kernels, as the module path does in that mode; steps of up to
        # MAX_TOKENS rows of any kind take this path, with the module path's bits.
        self.batch_invariant = False

    @classmethod
    def build(cls, model: LlamaModel) -> CpuDecodeLayers | None:
        """For a model whose fused CPU ops are on; None if any layer lacks a C++ path."""
        layer_args = []
        for layer in model.layers:
            if not getattr(layer, "cpu_decode_layer", False):  # Gemma 3's, an MoE layer
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if not all(m.ops == "cpu_ops" for m in (attn, mlp, layer.input_layernorm)):
                return None
            # Qwen3's per-head q/k norms (bf16 [head_dim]); decode_layer applies them with the
            # layers' eps, so a model whose head norms had another eps keeps the module path.
            head_norms = (None, None)
            if attn.q_norm is not None:
                head_norms = (attn.q_norm.weight, attn.k_norm.weight)
                if (any(w.dtype != torch.bfloat16 for w in head_norms)
                        or {attn.q_norm.eps, attn.k_norm.eps} != {layer.input_layernorm.eps}):
                    return None
            linears = [_linear_args(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(lin is None for lin in linears):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.bfloat16 for w in norms):
                return None
            layer_args.append((*norms, [lin[0] for lin in linears], [lin[1] for lin in linears],
                               [lin[2] for lin in linears], *head_norms,
                               attn.sliding_window or 0))  # 0: no window
        first = model.layers[0]
        decode = cls(layer_args, first.input_layernorm.eps, first.self_attn.num_heads,
                     first.self_attn.num_kv_heads)
        decode.rope_layers = [layer.self_attn.use_rope for layer in model.layers]
        return decode

    def applies(self, hidden: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this step can take the C++ path: decodes only (any rows in the
        batch-invariant mode), on the fused CPU backend of the same mode (LoRA rows included:
        the C++ layer adds their deltas as LoRABatch.apply does)."""
        n = hidden.shape[0]
        rows = 0 if self.batch_invariant else n  # decode rows the step must consist of
        return (0 < n <= self.MAX_TOKENS and ctx.meta.num_decodes == rows
                and hidden.dtype == torch.bfloat16 and getattr(ctx.backend, "fused_cpu_ops", False)
                and getattr(ctx.backend, "batch_invariant", False) == self.batch_invariant)

    def __call__(self, hidden: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None
                 ) -> torch.Tensor:
        """The hidden states after every layer, or the first `num_layers` (before the final
        norm); `hidden` is updated in place, as the module path's residual adds do."""
        rope_tables, scale = ctx.rope_tables, ctx.backend.scale
        # NoPE layers: the identity rotation (cos 1, sin 0), which leaves q and k bit for bit.
        identity = ((torch.ones_like(rope_tables[0]), torch.zeros_like(rope_tables[1]))
                    if not all(self.rope_layers) else None)
        decode_layer = torch.ops.argosy_cpu.decode_layer
        for i, (input_norm, post_norm, weights, kinds, params, q_norm, k_norm, window) in enumerate(
                self.layer_args[:num_layers]):
            cos, signed_sin = rope_tables if self.rope_layers[i] else identity
            meta = ctx.meta_for(i)  # this layer's block table (kv_cache/layout.py)
            if self.batch_invariant:  # per sequence: its block table, tokens in cache, rows
                tables, starts, lens = meta.prefill_sequences()
            else:  # per row
                tables, lens, starts = meta.decode_block_tables, meta.decode_context_lens, None
            key_cache, value_cache = ctx.kv_caches[i]
            k_scale, v_scale = ctx.kv_scales[i] if ctx.kv_scales is not None else (None, None)
            lora, lora_scales = ([], []) if ctx.lora is None else ctx.lora.decode_layer_args(i)
            decode_layer(hidden, input_norm, post_norm, self.eps, *weights, kinds, params,
                         key_cache, value_cache, k_scale, v_scale, meta.slot_mapping,
                         tables, lens, cos, signed_sin, self.num_heads, self.num_kv_heads, scale,
                         lora, lora_scales, starts, q_norm, k_norm, window)
        return hidden
