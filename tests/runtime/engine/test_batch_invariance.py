"""The batch-invariant mode: a request's tokens and logprobs are the same bits alone, in a busy
batch, with its prompt cut into other chunks, after a prefix-cache hit, after a preemption and
under speculative decoding (the embedded SmolLM2-135M in bfloat16, its real weights)."""

from __future__ import annotations

import random

import pytest
import torch
from argosy_kernels import cpu_ops
from argosy_runtime import LLM, SamplingParams
from argosy_runtime.batch_invariance import check_batch_invariant_options
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.models.cpu_linear import PackedLinear
from engine_helpers import (  # tests/runtime, on sys.path via conftest.py
    record_cpp_layer_calls,
    tokens_and_logprobs,
)
from model_factory import make_random_model_dir

pytestmark = pytest.mark.skipif(not cpu_ops.has_avx512_bf16(),
                                reason="the batch-invariant mode needs AVX512-BF16")

TARGET = ("Summarize the following in one sentence. The Roman Empire grew from a city state on "
          "the Tiber into a power that ruled the Mediterranean for centuries, and its roads, "
          "laws and language shaped Europe long after its fall.")
OTHERS = [("Write a short poem about the sea. " * k).strip() for k in range(1, 4)] + [
    "List three prime numbers:", "def fibonacci(n):", "1, 2, 3, 4, 5, 6, 7, 8,",
    "The capital of France is", "Translate to French: good morning, my friend.",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2-135m", dtype="bfloat16", batch_invariant=True)


@pytest.fixture(scope="module")
def alone(llm) -> tuple[list[int], list[float]]:
    return tokens_and_logprobs(llm.generate([TARGET], GREEDY)[0])


def test_same_bits_in_a_batch_and_after_a_prefix_hit(llm, alone) -> None:
    outs = llm.generate(OTHERS[:4] + [TARGET] + OTHERS[4:], GREEDY)
    assert tokens_and_logprobs(outs[4]) == alone
    # Again: now the prompt's blocks come from the prefix cache, computed in the first call.
    hits = llm.engine.get_stats().prefix_cache_hits
    assert tokens_and_logprobs(llm.generate([TARGET], GREEDY)[0]) == alone
    assert llm.engine.get_stats().prefix_cache_hits > hits


def test_same_bits_chunked_beside_others_and_preempted(alone) -> None:
    """16 tokens a step, at most 8 for one prompt: the prompt is prefilled in chunks beside
    other requests' chunks and decodes; 12 blocks of KV cache for 9 requests: some are
    preempted and recomputed."""
    busy = LLM(model="smollm2-135m", dtype="bfloat16", batch_invariant=True,
               max_num_batched_tokens=16, long_prefill_token_threshold=8,
               kv_cache_memory=12 * 16 * 23_040, max_model_len=128)
    outs = busy.generate(OTHERS[:2] + [TARGET] + OTHERS[2:], GREEDY)
    assert busy.engine.get_stats().num_preemptions > 0
    assert tokens_and_logprobs(outs[2]) == alone


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_same_bits_with_quantized_weights(quantization: str) -> None:
    """int4's many-row kernel and int8_matmul serve every row count in this mode (by default
    one row, a few rows and many rows take three different kernels)."""
    llm = LLM(model="smollm2-135m", dtype="bfloat16", batch_invariant=True,
              quantization=quantization, max_num_batched_tokens=32)
    alone = tokens_and_logprobs(llm.generate([TARGET], GREEDY)[0])
    assert tokens_and_logprobs(llm.generate(OTHERS[:2] + [TARGET] + OTHERS[2:], GREEDY)[2]) == alone
    assert llm.engine.model.cpu_decode is not None  # the C++ layers ran the quantized kinds


def test_same_bits_with_an_int8_kv_cache() -> None:
    """The int8 cache's tiles are dequantized per key, the same for any batch."""
    llm = LLM(model="smollm2-135m", dtype="bfloat16", batch_invariant=True, kv_cache_dtype="int8",
              max_num_batched_tokens=32)
    alone = tokens_and_logprobs(llm.generate([TARGET], GREEDY)[0])
    assert tokens_and_logprobs(llm.generate(OTHERS[:5] + [TARGET] + OTHERS[5:], GREEDY)[5]) == alone


def test_same_bits_with_speculative_decoding(alone) -> None:
    """n-gram proposals verified in chunks of 1 + k tokens give the one-at-a-time bits."""
    spec = LLM(model="smollm2-135m", dtype="bfloat16", batch_invariant=True, speculative="ngram")
    assert tokens_and_logprobs(spec.generate([TARGET], GREEDY)[0]) == alone
    drafted = spec.engine.get_stats().spec_decode_num_draft_tokens
    assert drafted > 0, "no n-gram proposal was verified: the test would not cover the path"


def test_cpp_layers_give_the_module_paths_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of up to 256 rows, chunks included, run each layer as one C++ call in this mode;
    longer ones take the module path. Both must give the same bits, or a request's result
    would depend on how many rows its steps had."""
    llm = LLM(model="smollm2-135m", dtype="bfloat16", batch_invariant=True,
              enable_prefix_caching=False, max_num_batched_tokens=64)
    calls = record_cpp_layer_calls(monkeypatch)
    prompts = [TARGET, *OTHERS[:3]]
    fast = [tokens_and_logprobs(o) for o in llm.generate(prompts, GREEDY)]
    assert max(calls) > len(prompts), "chunk rows took the C++ layers"
    llm.engine.model.cpu_decode = None
    calls.clear()
    assert [tokens_and_logprobs(o) for o in llm.generate(prompts, GREEDY)] == fast
    assert not calls


@pytest.mark.parametrize("options", [{}, {"quantization": "int8"}], ids=["bf16", "int8"])
def test_qwen3_cpp_layers_give_the_module_paths_bits(
        options: dict, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Qwen3's per-head q/k norms inside the C++ layers of this mode (chunk rows included):
    the module path's bits, and a request's bits alone equal its bits in a batch."""
    from model_factory import make_random_model_dir

    # 4 query heads of 64 (the mode's attention takes head_dim 64 or 128), 2 kv heads.
    folder = make_random_model_dir(tmp_path, "qwen3", hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64)
    llm = LLM(model=str(folder), dtype="bfloat16", batch_invariant=True, block_size=4,
              enable_prefix_caching=False, max_num_batched_tokens=64, **options)
    assert llm.engine.model.cpu_decode is not None, "the q/k norms have a C++ path"
    calls = record_cpp_layer_calls(monkeypatch)
    prompts = [TARGET, *OTHERS[:3]]
    fast = [tokens_and_logprobs(o) for o in llm.generate(prompts, GREEDY)]
    assert max(calls) > len(prompts), "chunk rows took the C++ layers"
    assert tokens_and_logprobs(llm.generate([TARGET], GREEDY)[0]) == fast[0]
    llm.engine.model.cpu_decode = None
    calls.clear()
    assert [tokens_and_logprobs(o) for o in llm.generate(prompts, GREEDY)] == fast
    assert not calls


def test_seeded_sampling_same_alone_and_in_a_batch(llm) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, logprobs=0)
    first = tokens_and_logprobs(llm.generate([TARGET], params)[0])
    batch = llm.generate(OTHERS[:3] + [TARGET], [GREEDY] * 3 + [params])
    assert tokens_and_logprobs(batch[3]) == first
    several = SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=3)  # siblings share a prefix
    alone = [c.token_ids for c in llm.generate([TARGET], several)[0].outputs]
    assert [c.token_ids for c in llm.generate([OTHERS[0], TARGET], several)[1].outputs] == alone


def test_each_linear_gives_a_row_the_same_bits_for_any_row_count(llm) -> None:
    """The premise for the linears: with at least 2 rows (PackedLinear.min_rows), oneDNN's
    result for a row does not depend on how many rows share the call. A torch or oneDNN
    upgrade that breaks it fails here, not in a user's outputs."""
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for module in llm.engine.model.modules():
        if not isinstance(module, PackedLinear):
            continue
        assert module.min_rows == 2
        shape = (module.in_features, module.out_features)
        if shape in seen:
            continue
        seen.add(shape)
        x = torch.randn(600, module.in_features, generator=gen).bfloat16()
        full = module(x)
        for rows in (1, 2, 3, 7, 16, 33, 64, 129, 300):
            start = int(torch.randint(0, 600 - rows, (), generator=gen))
            assert torch.equal(module(x[start : start + rows]), full[start : start + rows]), (shape, rows)
    assert len(seen) >= 5  # qkv, o, gate_up, down, lm_head


@pytest.mark.parametrize("change, message", [
    ({"dtype": "float32"}, "dtype float32: it needs bfloat16"),
])
def test_refuses_what_it_cannot_honour_before_loading(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model="/does/not/exist", batch_invariant=True, **{"dtype": "bfloat16", **change})


def test_refuses_cuda() -> None:
    with pytest.raises(ValueError, match="device cuda: it runs on the CPU only"):
        check_batch_invariant_options(EngineArgs(), torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize(("arch", "shape"), [
    # experts: each a packed linear over a token count that depends on the whole batch
    ("qwen3_moe", dict(head_dim=64, extra_config=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))),
    # four norms per layer, gelu-tanh, a local rotary table, sliding-window layers
    ("gemma3", dict(head_dim=64, init_std=0.15)),
    # the same layer with attention scores soft-capped (Gemma 2) and windows of 16
    ("gemma2", dict(head_dim=64, init_std=0.15, extra_config=dict(
        sliding_window=16, attn_logit_softcapping=1.0))),
])
def test_same_bits_for_moe_and_gemma3_layers(arch: str, shape: dict, tmp_path) -> None:  # noqa: ANN001
    folder = make_random_model_dir(tmp_path, arch, **shape)
    llm = LLM(model=str(folder), dtype="bfloat16", batch_invariant=True,
              max_num_batched_tokens=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    alone = tokens_and_logprobs(llm.generate([prompts[3]], GREEDY)[0])
    assert tokens_and_logprobs(llm.generate(prompts, GREEDY)[3]) == alone
