"""The engine's bfloat16 CPU path through the fused C++ kernels (argosy_kernels.cpu_ops):
on by default where they build, and at least as close to float32 as the eager bf16 ops."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from argosy_runtime import LLM, SamplingParams

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: the fused kernels are off")

PROMPTS = [
    "The history of the printing press begins in",
    "def quicksort(items):\n    if len(items) <= 1:",
    "Photosynthesis converts light energy into",
]


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    """Log-probability of every prompt token after the first, all prompts concatenated."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    values = []
    for out in outs:
        for token_id, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            values.append(entry[token_id].logprob)
    return torch.tensor(values, dtype=torch.float64)


def _set_fused(llm: LLM, enabled: bool) -> None:
    llm.engine.model.use_fused_cpu_ops(enabled)
    llm.engine.runner.backend.fused_cpu_ops = enabled


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return _prompt_logprobs(LLM(model="smollm2-135m", dtype="float32"))


def test_bfloat16_engine_uses_the_fused_kernels_and_stays_accurate(reference) -> None:
    llm = LLM(model="smollm2-135m", dtype="bfloat16")
    norm = llm.engine.model.model.layers[0].input_layernorm
    assert norm.ops == "cpu_ops" and llm.engine.runner.backend.fused_cpu_ops  # on by default
    fused = _prompt_logprobs(llm)
    _set_fused(llm, False)
    eager = _prompt_logprobs(llm)
    fused_err = (fused - reference).abs().mean().item()
    eager_err = (eager - reference).abs().mean().item()
    # Both are bf16 roundings of the same math: neither may be markedly worse.
    assert fused_err <= 1.25 * eager_err + 1e-3, (fused_err, eager_err)
    assert (fused - eager).abs().max().item() < 0.5


def test_bfloat16_greedy_decode_through_fused_attention(reference) -> None:
    # Decode steps take the fused paged attention; their first tokens match the float32 model.
    llm_fp32 = LLM(model="smollm2-135m", dtype="float32")
    llm_bf16 = LLM(model="smollm2-135m", dtype="bfloat16")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = [o.outputs[0].token_ids[:3] for o in llm_fp32.generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids[:3] for o in llm_bf16.generate(PROMPTS, params)]
    assert got == want


def test_float32_keeps_the_eager_elementwise_ops() -> None:
    llm = LLM(model="smollm2-135m", dtype="float32")
    assert llm.engine.model.model.layers[0].input_layernorm.ops == "torch"
