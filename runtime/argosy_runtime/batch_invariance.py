"""The batch-invariant mode (`batch_invariant=True`, `argosy serve --batch-invariant`).

By default a request's logits depend, in their last bits, on what else runs in its steps: the
decode attention kernel splits long contexts when the batch is small, a decode step runs
other kernels than a step that also carries a prompt chunk, and a prompt's chunks fall where
the token budget left by other requests puts them. In bfloat16 those bits are enough to flip
a greedy token now and then, so the same prompt can get a different answer under load.

In this mode every token's result is a function of its own request alone, bit for bit: the
same tokens and logprobs alone or in any batch, however its prompt was chunked, after a
prefix-cache hit or after a preemption. What makes it so (docs/engine.md, "Batch-invariant
mode"):
- attention: every query, decode rows included, through `cpu_ops.varlen_attention`, whose
  per-query arithmetic does not depend on the chunking or on the other queries;
- the C++ decode layers (steps of up to 256 rows of any kind) and the module path (longer
  steps) running the same kernels, so both give the same bits;
- linears through kernels that compute each row the same way for any number of rows: oneDNN
  from 2 rows on for bfloat16 (a single row is padded), int4's many-row kernel and
  int8_matmul for any row count (tests/runtime/engine/test_batch_invariance.py checks the
  model's shapes);
- LoRA deltas always through `lora_add`'s fused pass (by default larger batches switch to
  GEMMs), which computes each row on its own;
- row-wise norms, rotary, SiLU and sampling, with each seeded request on its own generator.

What is not covered is refused with the reason, rather than served with a silent exception.
"""

from __future__ import annotations

from typing import Any

import torch


def check_batch_invariant_options(args: Any, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError naming the option that the batch-invariant mode cannot honour (before the
    model loads)."""
    problems = []
    if device.type != "cpu":
        problems.append(f"device {device.type}: it runs on the CPU only (the Triton kernels "
                        "choose K and context splits by batch size)")
    if dtype != torch.bfloat16:
        problems.append(f"dtype {str(dtype).removeprefix('torch.')}: it needs bfloat16 "
                        "(float32 matmuls go through MKL, whose result for a row depends on "
                        "the number of rows)")
    if problems:
        raise ValueError("batch_invariant (--batch-invariant) cannot be honoured: "
                         + "; ".join(problems))


def check_batch_invariant_model(spec: Any) -> None:
    """ValueError unless the attention kernel of the mode runs here for this model."""
    from argosy_kernels import cpu_ops

    if not cpu_ops.has_avx512_bf16():
        why = ("the fused CPU kernels are off or failed to build (ARGOSY_CPU_OPS, a C++ "
               "compiler)" if not cpu_ops.available() else "this CPU has no AVX512-BF16")
        raise ValueError(f"batch_invariant (--batch-invariant) needs the bfloat16 attention "
                         f"kernel of argosy_kernels.cpu_ops: {why}")
    group = spec.num_attention_heads // spec.num_key_value_heads
    if spec.head_dim not in (64, 128) or group > 16:
        raise ValueError(f"batch_invariant (--batch-invariant) supports head_dim 64 or 128 and "
                         f"up to 16 query heads per kv head; this model has {spec.head_dim} "
                         f"and {group}")
