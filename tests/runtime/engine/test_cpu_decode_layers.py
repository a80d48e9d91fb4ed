"""Decode steps through `cpu_ops.decode_layer` (one C++ call per layer, models/cpu_decode.py)
give exactly the module path's tokens and log-probabilities, in every weight and cache mode."""

from __future__ import annotations

import os
import shutil

import pytest
from argosy_runtime import LLM, SamplingParams
from argosy_runtime.models.cpu_decode import CpuDecodeLayers

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: the fused kernels are off")

PROMPTS = [
    "The history of the printing press begins in",
    "def quicksort(items):\n    if len(items) <= 1:",
    "Photosynthesis",
]
# Three running sequences of different lengths, then fewer as the short budgets run out.
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True) for n in (12, 5, 9)]


def _generate(llm: LLM) -> list[tuple]:
    outs = llm.generate(PROMPTS, PARAMS)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("options", [{}, {"quantization": "int8"}, {"quantization": "int4"},
                                     {"kv_cache_dtype": "int8"}], ids=["bf16", "int8", "int4", "int8-kv"])
def test_cpu_decode_layers_equal_the_module_path(options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=32 << 20,
              enable_prefix_caching=False, **options)
    model = llm.engine.model
    assert model.cpu_decode is not None, "every linear of this mode has a C++ path"
    calls = []
    original = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__",
                        lambda self, h, *args: calls.append(h.shape[0]) or original(self, h, *args))
    fast = _generate(llm)
    assert sorted(set(calls)) == [1, 2, 3], "decode steps of 3, 2 and 1 sequences took the C++ path"
    model.cpu_decode = None
    assert _generate(llm) == fast


def test_float32_keeps_the_module_path() -> None:
    # float32 keeps transformers' exact op order: no fused elementwise ops, so no C++ layers
    assert LLM(model="smollm2-135m", dtype="float32", kv_cache_memory=16 << 20).engine.model.cpu_decode is None


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 5},
    {"method": "draft", "quantization": "int4", "num_speculative_tokens": 3},
], ids=["ngram", "int4-draft"])
def test_speculative_steps_take_the_cpp_path(speculative: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # Verification chunks (1 + k tokens) and a draft's catch-up run as decode rows, so those
    # steps take the C++ layers too, for the target and for a quantized draft model; the
    # module path over the same rows must give the same tokens.
    llm = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=32 << 20,
              enable_prefix_caching=False, speculative=speculative)
    target = llm.engine.model
    draft = getattr(llm.engine.proposer.proposer, "model", target)  # ngram: no draft model
    assert target.cpu_decode is not None and draft.cpu_decode is not None
    calls = []
    original = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__",
                        lambda self, h, *args: calls.append((self, h.shape[0])) or original(self, h, *args))
    prompt = ["Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fast = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert any(layers is target.cpu_decode and n > 1 for layers, n in calls), "verification rows"
    if draft is not target:
        assert any(layers is draft.cpu_decode for layers, _ in calls), "the draft's own steps"
    target.cpu_decode = draft.cpu_decode = None
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == fast
