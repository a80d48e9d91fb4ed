"""`SparseMoeBlock`: the Mixture-of-Experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

Each token's hidden state goes through a router (`gate`, a linear [num_experts, hidden]);
softmax over the experts in float32, the top `num_experts_per_tok` kept (renormalized to sum
to 1 for Mixtral, and for Qwen MoE when `norm_topk_prob`), and the token's output is the
weighted sum of those experts' SwiGLU MLPs. Qwen2-MoE adds an always-on shared expert scaled
by sigmoid(shared_expert_gate(x)). The op order is transformers 5's (Mixtral keeps the routing
weights in float32, Qwen MoE casts them to the model dtype first), so float32 outputs equal
transformers' to rounding.

Every expert is an ordinary `llama.MLP` (gate_up fused, down) in a ModuleList, so everything
that handles the dense MLP's linears handles the experts' unchanged: the bf16 oneDNN packing
(cpu_linear.pack_linears_for_cpu), int8/int4 weight quantization (quantization/apply.py
quantizes every `gate_up_proj` / `down_proj` under model.layers), the fused SiLU x up ops.
The router and the shared-expert gate stay in float (neither name is quantized).

Compute is per expert over only the tokens routed to it (index_select, then index_add_ of the
weighted outputs), like transformers' eager experts. Grouping the tokens reads the routing on
the host (one sync per layer), so a model with these blocks runs CUDA decode steps eagerly
(model_runner.use_cuda_graphs), and the fused C++ decode layer (cpu_decode.py) is not built
for it. With the Triton ops (CUDA: `LlamaForCausalLM.use_triton_ops`) and unquantized experts
the block runs `argosy_kernels.fused_moe` instead: two grouped GEMMs over all experts, the
experts' weights stacked once (each expert's Linear keeps a view of its slice), no host read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from argosy_kernels.fused_moe import fused_moe
from torch import nn

from argosy_runtime.models.llama import MLP

if TYPE_CHECKING:
    from argosy_runtime.lora import LoRABatch
    from argosy_runtime.model_loader import ModelSpec


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.float32_weights = spec.router_weights_in_float32
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(spec, layer_idx, spec.moe_intermediate_size) for _ in range(spec.num_experts))
        shared = spec.shared_expert_intermediate_size
        self.shared_expert = MLP(spec, layer_idx, shared) if shared else None
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False) if shared else None
        self.tensor_parallel = None  # set on a tensor-parallel rank (use_tensor_parallel)
        # (gate_up [E, 2I, H], down [E, H, I]) while the Triton path runs the experts
        self.stacked_experts: tuple[torch.Tensor, torch.Tensor] | None = None

    def use_fused_experts(self, enabled: bool = True) -> bool:
        """Run the experts through argosy_kernels.fused_moe (on: stack their weights, each
        expert's Linear then holding a view of its slice, so no second copy). Only plain
        unquantized linears without bias stack; otherwise the per-expert loop stays. Returns
        whether the fused path is on."""
        linears = [(mlp.gate_up_proj, mlp.down_proj) for mlp in self.experts]
        if not enabled or not all(type(lin) is nn.Linear and lin.bias is None
                                  for pair in linears for lin in pair):
            self.stacked_experts = None
            return False
        stacked = tuple(torch.stack([pair[i].weight.detach() for pair in linears])
                        for i in (0, 1))
        for e, pair in enumerate(linears):
            for i, lin in enumerate(pair):
                lin.weight = nn.Parameter(stacked[i][e], requires_grad=False)
        self.stacked_experts = stacked
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k], expert ids [tokens, top_k]) of each token of x [tokens,
        hidden]: float32 softmax over the experts, top-k, renormalized where the model does."""
        logits = self.gate(x)  # [tokens, num_experts]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]. `lora` is not applied here: the engine
        refuses adapters on an MoE layer's MLP (lora/adapter.py); attention ones apply."""
        weights, experts = self.route(x)
        if self.stacked_experts is not None:
            out = fused_moe(x, *self.stacked_experts, weights, experts)
        else:
            out = self._experts_one_by_one(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        if self.tensor_parallel is not None:  # each rank ran its share of every expert
            self.tensor_parallel.all_reduce(out)
        return out

    def _experts_one_by_one(self, x: torch.Tensor, weights: torch.Tensor,
                            experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # The (token, slot) pairs grouped by expert: a stable sort of the flat expert ids
        # keeps each expert's tokens in order. One host read for the group sizes.
        flat = experts.flatten()  # [tokens * top_k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // self.top_k
            h = self.experts[e](x.index_select(0, tokens))
            # Mixtral: bf16 x float32 weight -> float32, rounded once into out (transformers).
            h = h * flat_weights.index_select(0, pairs).unsqueeze(-1)
            out.index_add_(0, tokens, h.to(out.dtype))
        return out
