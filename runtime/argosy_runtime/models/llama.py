"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flattened token batch.
Mixtral, Qwen2-MoE and Qwen3-MoE are the same decoder with models/moe.py's sparse MoE block
in place of the MLP (in every layer, or those the spec's `sparse_layers` name). Gemma 3 is
models/gemma3.py's layer around the same Attention and MLP, plus switches the spec drives
(Gemma norms, gelu-tanh, embedding scale, a local rotary table, logit soft-capping).
SmolLM3 is this decoder with no rotary in its NoPE layers (`spec.nope_layers`); Granite is this
decoder with its four multipliers (embeddings, residual branches, attention scale, logits).

No padding: the batch is every scheduled token of every request, one after another
([num_tokens, hidden]); attention finds each token's sequence through AttentionMetadata.
q/k/v and gate/up projections are fused into single matmuls (fewer, larger GEMMs).

`use_fused_cpu_ops(True)` routes the small per-layer ops (norms, residual adds, rotary, SiLU)
through the fused C++ kernels of argosy_kernels.cpu_ops: one call each instead of 3-10
PyTorch ops. The engine turns it on for bfloat16 on the CPU; float32 keeps the eager ops,
which equal transformers' bit for bit.

`use_triton_ops(True)` does the same for norms, residual adds, rotary and SiLU with the Triton
kernels (`argosy_kernels.rms_norm`, `.rotary_embedding`, `.silu_and_mul`), and MoE experts with
`.fused_moe`; the engine turns it on on CUDA.
They compute in float32 and round once, so in float32 they agree with the eager ops to an ulp
and in half precision they are at least as exact (eager rounds after every multiply).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops
from argosy_kernels.rms_norm import rms_norm as triton_rms_norm
from argosy_kernels.rotary_embedding import rotary_embedding as triton_rotary_embedding
from argosy_kernels.silu_and_mul import silu_and_mul as triton_silu_and_mul
from torch import nn

from argosy_runtime.models.cpu_decode import CpuDecodeLayers
from argosy_runtime.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from argosy_runtime.attention import AttentionMetadata
    from argosy_runtime.lora import LoRABatch
    from argosy_runtime.model_loader import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, gemma: bool = False) -> None:
        """`gemma`: Gemma's RMSNorm, normalized x times (1 + w) in float32, rounded once. The
        weight holds 1 + w (folded at load) in float32 whatever the model dtype; the C++
        kernel (Llama's order, weight of x's dtype) is not used for it, the Triton kernel
        (float32 weight, one rounding) is."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.gemma = gemma
        self.ops = "torch"  # or "cpu_ops" / "triton": set by LlamaForCausalLM.use_*_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops == "cpu_ops" and not self.gemma:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        if self.ops == "triton":
            return triton_rms_norm(x, self.weight, self.eps)
        # Same op order as transformers' LlamaRMSNorm (variance in float32).
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:  # Gemma3RMSNorm: (h * (1 + w).float()).to(dtype)
            return (h * self.weight).to(dtype)
        return self.weight * h.to(dtype)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)); the fused ops update `residual` in place."""
        if self.ops == "cpu_ops" and not self.gemma:
            return residual, cpu_ops.add_rms_norm(residual, x, self.weight, self.eps)
        if self.ops == "triton":
            out, residual = triton_rms_norm(x, self.weight, self.eps, residual)
            return residual, out
        residual = residual + x
        return residual, self(residual)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        # Qwen3, Gemma 3: each query and key head RMS-normalized (over head_dim) before the rotary.
        norm = lambda: RMSNorm(self.head_dim, spec.rms_norm_eps, spec.gemma_norms)  # noqa: E731
        self.q_norm = norm() if spec.qk_norm else None
        self.k_norm = norm() if spec.qk_norm else None
        # Gemma 3's sliding-window layers rotate with their own table (ctx.local_rotary).
        self.local_rope = spec.local_rope(layer_idx)
        # SmolLM3's NoPE layers leave q and k unrotated.
        self.use_rope = spec.uses_rope(layer_idx)
        self.ops = "torch"  # or "cpu_ops" / "triton": set by LlamaForCausalLM.use_*_ops
        # This layer's attention window (keys p - W < k <= p), None: full causal attention.
        self.sliding_window = spec.sliding_window(layer_idx)
        self._window_kwargs = {} if self.sliding_window is None else {"sliding_window": self.sliding_window}
        if spec.attn_logit_softcapping is not None:  # Gemma 2: scores soft-capped on every path
            self._window_kwargs["softcap"] = spec.attn_logit_softcapping
        # Set on a tensor-parallel rank (use_tensor_parallel): o_proj's output is this rank's
        # partial sum over its heads, added up over the ranks.
        self.tensor_parallel: Any = None

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        if ctx.lora is not None:
            ctx.lora.apply(qkv, h, self.layer_idx, "qkv_proj")
        # q and k are adjacent in qkv: rotate both heads at once (one pass, half the ops).
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        if self.use_rope:
            qk = self._rotate(qk, ctx)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, key_cache, value_cache, ctx.meta_for(self.layer_idx),
                                  **ctx.cache_kwargs(self.layer_idx), **self._window_kwargs)
        out = out.reshape(-1, self.q_size)
        o = self.o_proj(out)
        if ctx.lora is not None:
            ctx.lora.apply(o, out, self.layer_idx, "o_proj")
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(o)
        return o

    def _rotate(self, qk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q and k heads [tokens, heads + kv_heads, head_dim] rotated by position (in place
        on the fused ops)."""
        rotary, rope_tables = ((ctx.local_rotary, ctx.local_rope_tables) if self.local_rope
                               else (ctx.rotary, ctx.rope_tables))
        if self.ops == "cpu_ops":  # in place, inside qkv (or the normalized copy)
            cpu_ops.rotary_embedding(qk, *rope_tables)
        elif self.ops == "triton":  # in place, inside qkv
            triton_rotary_embedding(ctx.positions, qk, None, rotary.cos_sin_cache)
        else:
            qk = rotary.rotate(qk, rope_tables)
        return qk

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """[tokens, heads + kv_heads, head_dim] -> the same with every query head through
        q_norm and every key head through k_norm (a new tensor; the norms read 2-D rows)."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return torch.cat([q, k], dim=1)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, intermediate_size: int | None = None
                 ) -> None:
        """`intermediate_size`: spec.intermediate_size unless given (an MoE expert's)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = intermediate_size or spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, spec.hidden_size, bias=False)
        self.ops = "torch"  # "cpu_ops" / "triton": SiLU x up in one kernel
        # Gemma: gelu (tanh approximation) x up, torch ops on every path (the kernels are SiLU's).
        self.gelu_tanh = spec.hidden_act == "gelu_pytorch_tanh"
        # Set on a tensor-parallel rank for a layer's MLP (not an MoE expert's: the MoE block
        # adds its experts up first): down_proj's output is a partial sum over the ranks.
        self.tensor_parallel: Any = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(gate_up, x, self.layer_idx, "gate_up_proj")
        if self.gelu_tanh:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        elif self.ops == "cpu_ops":
            act = cpu_ops.silu_and_mul(gate_up)
        elif self.ops == "triton":
            act = triton_silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act)
        if lora is not None:
            lora.apply(out, act, self.layer_idx, "down_proj")
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    # CpuDecodeLayers may run this layer as one cpu_ops.decode_layer call, which knows this
    # layer with a dense MLP only (an MoE layer, like Gemma 3's layer, takes the module path).
    cpu_decode_layer = True

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx)
        if spec.is_sparse_layer(layer_idx):  # Mixtral / Qwen-MoE: a sparse MoE block
            from argosy_runtime.models.moe import SparseMoeBlock

            self.mlp: nn.Module = SparseMoeBlock(spec, layer_idx)
            self.cpu_decode_layer = False
        else:
            self.mlp = MLP(spec, layer_idx)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Granite scales each block's output before its residual add; the C++ decode layer
        # knows no such factor, so such a layer takes the module path.
        self.residual_multiplier = spec.residual_multiplier
        if self.residual_multiplier != 1.0:
            self.cpu_decode_layer = False

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), ctx)
        if self.residual_multiplier != 1.0:  # transformers' residual + out * multiplier
            attn = attn * self.residual_multiplier
        h, x = self.post_attention_layernorm.add_and_norm(h, attn)
        out = self.mlp(x, ctx.lora)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return h + out


class ForwardContext:
    """What every layer needs besides its input: the cache, the backend, step metadata."""

    def __init__(self, rotary: RotaryEmbedding, backend: Any, kv_caches: list, meta: AttentionMetadata,
                 kv_scales: list | None = None) -> None:
        self.rotary = rotary
        self.backend = backend
        self.kv_caches = kv_caches  # per layer: (key_cache, value_cache)
        self.meta = meta
        self.kv_scales = kv_scales  # per layer: (k_scale, v_scale) for the int8 cache, else None
        # Set once per step by LlamaForCausalLM.set_positions:
        self.positions: torch.Tensor | None = None  # [num_tokens], for the Triton rotary
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # for the others
        # The same for the layers with their own table (Gemma 3's sliding-window layers).
        self.local_rotary: RotaryEmbedding | None = None
        self.local_rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lora: LoRABatch | None = None  # rows that use LoRA adapters this step
        # An encoder's step (models/bert.py): per sequence, where token type 1 starts (None:
        # all type 0), from each request's PoolingParams.token_type_start.
        self.token_type_starts: list[int | None] | None = None
        # A hybrid KV layout (kv_cache/layout.py): per layer, the block table it reads. Set
        # per step from the model (LlamaForCausalLM.kv_layer_tables); None: one table.
        self.layer_tables: tuple[int, ...] | None = None

    def meta_for(self, layer_idx: int) -> AttentionMetadata:
        """The step's metadata for this layer's block table."""
        if self.layer_tables is None:
            return self.meta
        return self.meta.for_table(self.layer_tables[layer_idx])

    def cache_kwargs(self, layer_idx: int) -> dict[str, torch.Tensor]:
        if self.kv_scales is None:
            return {}
        k_scale, v_scale = self.kv_scales[layer_idx]
        return {"k_scale": k_scale, "v_scale": v_scale}


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        # An explicit weight skips Embedding's random init: on the meta device its normal_
        # would import torch._dynamo, 2 s of every cold start.
        self.embed_tokens = nn.Embedding(
            spec.vocab_size, spec.hidden_size,
            _weight=torch.empty(spec.vocab_size, spec.hidden_size),
        )
        layer_cls: type[nn.Module] = DecoderLayer
        if spec.is_gemma:  # Gemma 2 / 3: four norms per layer
            from argosy_runtime.models.gemma3 import Gemma3DecoderLayer

            layer_cls = Gemma3DecoderLayer
        self.layers = nn.ModuleList(layer_cls(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma_norms)


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.spec = spec
        # Build on the meta device and allocate uninitialized storage afterwards: random
        # initialization of every weight would only be overwritten by the checkpoint. The
        # dtype is set while still on meta (free), so storage is allocated once, in `dtype`:
        # a float32 pass first faulted in twice the bytes (a 1B-shaped model: 3.1 s -> 0.75 s).
        with torch.device("meta"):
            self.model = LlamaModel(spec)
            # A headless checkpoint (an embedding model) has no head: its output is `forward`'s
            # hidden states, and no vocab x hidden matrix is allocated, packed or quantized.
            self.lm_head: nn.Module | None = (
                nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if spec.has_lm_head else None
            )
            # A sequence classifier's head instead (reward models, cross-encoders): the last
            # token's hidden state -> num_labels logits. Tiny, so quantization leaves it in
            # float.
            self.score: nn.Linear | None = (
                nn.Linear(spec.hidden_size, spec.num_labels, bias=False) if spec.num_labels
                else None
            )
        self.to(dtype)
        if self.score is not None and spec.classifier_method:
            # Made of lm_head rows (an LLM reranker: P(yes) from yes - no): float32, as vLLM
            # keeps it; the difference of two close rows would lose digits in bfloat16.
            self.score.float()
        if spec.gemma_norms:  # 1 + w kept in float32: Gemma multiplies by it in float32
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.float()
        self.dtype = dtype
        self.to_empty(device=device)
        if spec.tie_word_embeddings:  # never for a headless spec (ModelSpec checks)
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cpu_decode: CpuDecodeLayers | None = None  # set by use_fused_cpu_ops
        self.tensor_parallel: Any = None  # set by use_tensor_parallel
        # Per layer, the block table it reads (kv_cache/layout.py): set by the model runner
        # whose cache has a hybrid layout; None: one table.
        self.kv_layer_tables: tuple[int, ...] | None = None
        # Chunks up to this long are decode rows (attention/batch.py build_batch): set by
        # use_fused_cpu_ops, for which they are cheaper; 1 (decodes only) elsewhere.
        self.decode_rows_up_to = 1
        self.ops = "torch"  # the small ops' kernels: "torch", "cpu_ops" or "triton"
        self.rotary = RotaryEmbedding(
            spec.head_dim, max_positions or spec.max_position_embeddings, spec.rope_theta,
            spec.rope_scaling, dtype, rotary_dim=spec.rotary_dim,
        )
        # Gemma 3: the sliding-window layers' own rotary (local_rope_theta, no scaling), and
        # the embeddings' factor: Gemma's sqrt(hidden_size) rounded to the model dtype first,
        # Granite's embedding_multiplier as it is (transformers multiplies by the float).
        self.local_rotary = None if spec.local_rope_theta is None else RotaryEmbedding(
            spec.head_dim, max_positions or spec.max_position_embeddings, spec.local_rope_theta,
            None, dtype)
        self.embed_scale = spec.embedding_scale
        if self.embed_scale is not None and spec.is_gemma:
            self.embed_scale = float(torch.tensor(self.embed_scale, dtype=torch.float32).to(dtype))

    def use_device_kernels(self) -> None:
        """The fastest kernels for where the weights now are (call after moving the model):
        on the CPU in bfloat16, oneDNN-prepacked linears and the fused C++ ops (float32 keeps
        the eager ops, which equal transformers' bit for bit); on CUDA, the Triton norms,
        rotary and SiLU. The engine does this for its model and the draft proposer for a draft model."""
        weight = self.model.norm.weight  # plain in every mode (embeddings may be int8)
        if weight.device.type == "cpu" and self.dtype == torch.bfloat16:
            from argosy_runtime.models.cpu_linear import pack_linears_for_cpu

            pack_linears_for_cpu(self)
            self.use_fused_cpu_ops()
        elif weight.device.type == "cuda":
            self.use_triton_ops()

    def use_fused_cpu_ops(self, enabled: bool = True) -> bool:
        """Route norms, residual adds, rotary and SiLU through argosy_kernels.cpu_ops (CPU,
        float32 or bfloat16). On only if the kernels build here; returns whether they are."""
        enabled = enabled and cpu_ops.available()
        self._set_ops("cpu_ops" if enabled else "torch")
        # Decode steps then run each layer as one C++ call where every linear has one.
        # (Not for a tensor-parallel rank: a C++ layer has no all-reduce inside.)
        self.cpu_decode = (CpuDecodeLayers.build(self.model)
                           if enabled and self.tensor_parallel is None else None)
        self.decode_rows_up_to = CpuDecodeLayers.CHUNK_AS_DECODE_ROWS if self.cpu_decode else 1
        return enabled

    def use_tensor_parallel(self, group: Any) -> None:
        """Make this model (built from distributed.tensor_parallel.shard_spec, its weights
        sliced by ShardedCheckpoint) one rank of `group`: every attention and MLP block sums
        its output over the ranks. The C++ decode layers go off (they have no all-reduce);
        the fused small ops stay."""
        self.tensor_parallel = group
        for layer in self.model.layers:
            layer.self_attn.tensor_parallel = group
            layer.mlp.tensor_parallel = group
        self.cpu_decode = None
        self.decode_rows_up_to = 1

    def use_batch_invariant_kernels(self) -> None:
        """Kernels whose result for a token does not depend on the batch (batch_invariance.py):
        every token a chunk row for varlen attention (decode rows would take the decode
        attention kernel, which splits long contexts by batch size), every linear through a
        kernel whose result for a row does not depend on the row count (bf16 with at least 2
        rows, int4's many-row kernel, int8_matmul), and the C++ layers (for steps of up to 256
        rows) doing the same."""
        from argosy_runtime.models.cpu_linear import PackedLinear
        from argosy_runtime.quantization.int4_linear import Int4Linear
        from argosy_runtime.quantization.int8_linear import Int8Linear

        for name, module in self.named_modules():
            if type(module) is nn.Linear:
                raise ValueError(f"batch_invariant needs oneDNN-packed bfloat16 linears; {name} is "
                                 "not packed (torch.backends.mkldnn unavailable?)")
            if isinstance(module, Int4Linear) and not module._plain_cpu_ops:
                raise ValueError(f"batch_invariant: int4 layer {name} is not in the plain cpu_ops "
                                 "layout (act-order, padding or a bias), which has no "
                                 "row-count-independent kernel")
            if isinstance(module, PackedLinear):
                module.min_rows = 2
            elif isinstance(module, (Int4Linear, Int8Linear)):
                module.batch_invariant = True
        if self.cpu_decode is not None:
            self.cpu_decode.batch_invariant = True
        self.decode_rows_up_to = 0

    def use_triton_ops(self, enabled: bool = True) -> None:
        """Route norms, residual adds, rotary and SiLU through the Triton kernels, and
        unquantized MoE experts through fused_moe (CUDA, or the CPU under TRITON_INTERPRET=1).
        Graph safe: no host reads of device values. Call it after
        moving the model to its device."""
        if enabled and self.cpu_decode is not None:
            raise ValueError("use_fused_cpu_ops is on: turn it off before use_triton_ops")
        if enabled:
            self.rotary.build_cos_sin_cache()
            if self.local_rotary is not None:
                self.local_rotary.build_cos_sin_cache()
        self._set_ops("triton" if enabled else "torch")
        for layer in self.model.layers:  # MoE blocks: all experts in two grouped GEMMs
            if hasattr(layer.mlp, "use_fused_experts"):
                layer.mlp.use_fused_experts(enabled)

    def _set_ops(self, ops: str) -> None:
        self.ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    def set_positions(self, ctx: ForwardContext, positions: torch.Tensor) -> None:
        """Give ctx the step's positions in the form this model's rotary reads (once per
        step, shared by every layer)."""
        ctx.positions = positions
        ctx.local_rotary = self.local_rotary
        ctx.layer_tables = self.kv_layer_tables
        if self.ops != "triton":
            ctx.rope_tables = self.rotary.tables(positions)
            if self.local_rotary is not None:
                ctx.local_rope_tables = self.local_rotary.tables(positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states after the final norm: [num_tokens, hidden]. `num_layers` runs only
        the first layers (a self-draft: the target's early layers + its norm and head)."""
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma, Granite
            h = h * self.embed_scale
        self.set_positions(ctx, positions)
        if self.cpu_decode is not None and self.cpu_decode.applies(h, ctx):
            return self.model.norm(self.cpu_decode(h, ctx, num_layers))
        for layer in self.model.layers[:num_layers]:
            h = layer(h, ctx)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits for the sampler. Raises RuntimeError for a model without
        an lm_head (spec.has_lm_head False), which cannot generate."""
        if self.lm_head is None:
            if self.score is not None:
                raise RuntimeError(
                    f"this {self.spec.architecture} model has a classification head, not a "
                    "language-model head (a sequence-classification checkpoint): it serves "
                    "classification and scores only")
            raise RuntimeError(
                f"this {self.spec.architecture} model has no language-model head (a headless "
                "embedding checkpoint): it serves embeddings only"
            )
        logits = self.lm_head(hidden).float()
        if self.spec.logits_scaling != 1.0:  # Granite (divided in float32: in the model dtype
            logits = logits / self.spec.logits_scaling  # for transformers; equal in float32)
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # Gemma's optional soft-capping, transformers' op order
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compute_class_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, num_labels] float32 logits of the classification head (`score`), for hidden
        states [n, hidden]. Raises RuntimeError for a model without one."""
        if self.score is None:
            raise RuntimeError(f"this {self.spec.architecture} model has no classification head "
                               "(not a sequence-classification checkpoint)")
        if self.spec.classifier_method:  # a float32 head of lm_head rows: float32 input
            hidden = hidden.float()
        return self.score(hidden).float()

    # ---- weights ------------------------------------------------------------------------
    # HF name suffix -> (our parameter suffix, shard index within the fused parameter)
    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def fused_shard_sizes(self, fused_name: str) -> list[int]:
        s = self.spec
        if fused_name == "qkv_proj":
            kv = s.num_key_value_heads * s.head_dim
            return [s.num_attention_heads * s.head_dim, kv, kv]
        return [s.intermediate_size, s.intermediate_size]

    # Mixtral's Hub names: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down).
    _MIXTRAL_EXPERT = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                       "w2": ("down_proj", None)}

    def map_weight_name(self, hf_name: str) -> tuple[str, int | None]:
        """HF parameter name -> (our parameter name, shard index or None if not fused)."""
        if ".block_sparse_moe." in hf_name:  # Mixtral: our MoE block is `mlp` in every model
            hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
            parts = hf_name.split(".")
            if len(parts) >= 2 and parts[-2] in self._MIXTRAL_EXPERT:
                ours, shard = self._MIXTRAL_EXPERT[parts[-2]]
                return ".".join(parts[:-2] + [ours, parts[-1]]), shard
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in self._FUSED:
            fused, shard = self._FUSED[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return hf_name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters. Returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            name, shard = self.map_weight_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to this model")
            if self.spec.gemma_norms and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0  # Gemma scales by 1 + w: stored folded (float32)
            param = params[name]
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"shape mismatch for {hf_name}: checkpoint {tuple(tensor.shape)}, "
                        f"model {tuple(param.shape)}"
                    )
                param.copy_(tensor)
            else:
                fused = name.rsplit(".", 2)[-2]
                # gate_up halves from the parameter: an MoE expert's (or shared expert's)
                # intermediate size is not spec.intermediate_size.
                sizes = (self.fused_shard_sizes(fused) if fused == "qkv_proj"
                         else [param.shape[0] // 2] * 2)
                offset = sum(sizes[:shard])
                target = param.narrow(0, offset, sizes[shard])
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"shape mismatch for {hf_name}: checkpoint {tuple(tensor.shape)}, "
                        f"model {tuple(target.shape)}"
                    )
                target.copy_(tensor)
            loaded.add(f"{name}#{shard}" if shard is not None else name)
        return loaded

    def check_all_loaded(self, loaded: set[str]) -> None:
        expected = set()
        for name, _ in self.named_parameters():
            fused = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                n = 3 if fused == "qkv_proj" else 2
                expected.update(f"{name}#{i}" for i in range(n))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
