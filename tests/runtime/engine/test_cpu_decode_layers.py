"""Decode steps through `cpu_ops.decode_layer` (one C++ call per layer, models/cpu_decode.py)
give exactly the module path's tokens and log-probabilities, in every weight and cache mode."""

from __future__ import annotations

import os
import shutil

import pytest
from argosy_runtime import LLM, SamplingParams
from argosy_runtime.models.cpu_decode import CpuDecodeLayers
from engine_helpers import record_cpp_layer_calls  # tests/runtime, on sys.path via conftest.py

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
    calls = record_cpp_layer_calls(monkeypatch)
    fast = _generate(llm)
    assert sorted(set(calls)) == [1, 2, 3], "decode steps of 3, 2 and 1 sequences took the C++ path"
    model.cpu_decode = None
    assert _generate(llm) == fast


# Qwen3 (conftest's random_qwen3_dir, model_factory.QWEN3_TEST_SHAPE): its q/k norm weights
# are random, so a skipped or misplaced head norm changes the tokens.
@pytest.mark.parametrize("options", [{}, {"quantization": "int8"}, {"kv_cache_dtype": "int8"}],
                         ids=["bf16", "int8", "int8-kv"])
def test_qwen3_cpu_decode_layers_equal_the_module_path(
        random_qwen3_dir, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """decode_layer applies Qwen3's per-head q/k norms (after the qkv linear, before the
    rotary) as Attention._norm_heads does: the C++ path runs and gives the same bits."""
    llm = LLM(model=str(random_qwen3_dir), dtype="bfloat16", kv_cache_memory=8 << 20, block_size=4,
              enable_prefix_caching=False, **options)
    model = llm.engine.model
    assert model.spec.qk_norm and model.cpu_decode is not None, "the q/k norms have a C++ path"
    calls = record_cpp_layer_calls(monkeypatch)
    fast = _generate(llm)
    assert sorted(set(calls)) == [1, 2, 3], "decode steps of 3, 2 and 1 sequences took the C++ path"
    model.cpu_decode = None
    calls.clear()
    assert _generate(llm) == fast
    assert not calls


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


def _random_adapter(folder, spec, rank: int, seed: int, modules: list[str]):  # noqa: ANN001, ANN201
    """A PEFT-format LoRA adapter with random A and B for the embedded model's shapes."""
    import json

    import torch
    from safetensors.torch import save_file

    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    shapes = {"q_proj": (spec.hidden_size, q), "k_proj": (spec.hidden_size, kv),
              "v_proj": (spec.hidden_size, kv), "o_proj": (q, spec.hidden_size),
              "gate_proj": (spec.hidden_size, spec.intermediate_size),
              "up_proj": (spec.hidden_size, spec.intermediate_size),
              "down_proj": (spec.intermediate_size, spec.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for module in modules:
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}))
    return folder


@pytest.mark.parametrize("options", [{}, {"quantization": "int4"}], ids=["bf16", "int4"])
def test_lora_rows_take_the_cpp_path_with_the_module_paths_tokens(
        options: dict, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps with LoRA rows (two adapters and base rows, then one adapter's rows alone) run
    the C++ layers, which add the deltas as LoRABatch.apply does: same tokens, logprobs."""
    from argosy_runtime.model_loader import load_checkpoint

    spec = load_checkpoint("smollm2-135m").spec
    adapters = {
        "all": _random_adapter(tmp_path / "all", spec, 8, 1, [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        "some": _random_adapter(tmp_path / "some", spec, 4, 2, ["v_proj", "down_proj"]),
    }
    llm = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=32 << 20,
              enable_prefix_caching=False, lora_modules={k: str(v) for k, v in adapters.items()},
              **options)
    engine, model = llm.engine, llm.engine.model
    calls = []
    original = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__", lambda self, h, ctx, *args: calls.append(
        (h.shape[0], ctx.lora is not None)) or original(self, h, ctx, *args))
    jobs = [("all", 14), ("some", 6), (None, 8), (None, 4)]  # r0 and r3: the same prompt

    def run() -> dict:
        for i, (lora, n) in enumerate(jobs):
            engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(
                max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True), lora_name=lora)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    o = out.outputs[0]
                    done[out.request_id] = (o.token_ids, [sorted(d.items()) for d in o.logprobs])
        return done

    fast = run()
    assert (4, True) in calls and (1, True) in calls, "mixed and single-adapter LoRA steps"
    model.cpu_decode = None
    slow = run()
    assert slow == fast
    assert fast["r0"][1][:4] != fast["r3"][1]  # the adapter changes the log-probabilities
