"""The Phi-3 family (Phi3ForCausalLM: Phi-3-mini-4k/128k, Phi-3-medium, Phi-3.5-mini, Phi-4,
Phi-4-mini) equals transformers' Phi3ForCausalLM.

Two tiny random checkpoints, saved by transformers with Phi-3's fused `qkv_proj` and
`gate_up_proj` tensors:
- "4k": plain rotary and a sliding window over every layer (Phi-3-mini-4k's 2047, here 10);
- "mini": longrope (short and long factor lists, original_max_position_embeddings 64 of 256)
  with partial_rotary_factor 0.75 (Phi-4-mini: 48 of each 64-wide head rotated).

Greedy tokens and logprobs equal transformers' in float32 (1e-4) through chunked prefill,
prefix-cache hits and preemption. Longrope takes the short factors when max_model_len <=
original_max_position_embeddings, the long ones above it (vLLM's rule), which equals
transformers for short sequences in the first case and long prompts in the second. bfloat16
(the fused C++ rotary and decode layers, partial rotary included) stays close; int8 runs.
Both models written as llama.cpp's phi3 GGUF files load equal to the folders.
"""

from __future__ import annotations

import pytest
from argosy_runtime import LLM, LLMEngine
from argosy_runtime.model_loader.gguf_metadata import open_gguf
from engine_helpers import (
    FullForwardReference,
    assert_equals_reference,
    assert_no_leaks,
    check_prefix_hits_and_preemption,
    greedy,
    random_prompts,
)
from model_factory import make_random_model_dir, write_gguf_from_hf_dir

WINDOW = 10
ORIGINAL = 64  # the longrope model's original_max_position_embeddings
MAX_POSITIONS = 256
# Phi-4-mini's shape in small: head_dim 64, 48 of it rotated, 24 factors per list.
MINI_SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=128)
ROTARY_HALF = 24
LONGROPE = {"rope_type": "longrope", "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.05 * i for i in range(ROTARY_HALF)],
            "long_factor": [1.5 + 0.5 * i for i in range(ROTARY_HALF)]}


@pytest.fixture(scope="module")
def phi3_4k(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = make_random_model_dir(
        tmp_path_factory.mktemp("models"), "phi3", name="phi3-4k",
        max_position_embeddings=MAX_POSITIONS,
        extra_config={"sliding_window": WINDOW, "original_max_position_embeddings": MAX_POSITIONS,
                      "eos_token_id": [2, 7]})
    return folder, FullForwardReference.from_folder(folder)


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = make_random_model_dir(
        tmp_path_factory.mktemp("models"), "phi3", name="phi4-mini", init_std=0.2,
        max_position_embeddings=MAX_POSITIONS, rope_scaling=LONGROPE,
        extra_config={"original_max_position_embeddings": ORIGINAL}, **MINI_SHAPE)
    return folder, FullForwardReference.from_folder(folder)


@pytest.fixture(scope="module")
def phi4_mini_small_weights(tmp_path_factory):  # noqa: ANN001, ANN201
    """The same shape with smaller weights: bf16 rounding then moves logprobs by a few 0.01
    (at init_std 0.2 transformers' own bf16 forward is tenths away from its float32 one)."""
    folder = make_random_model_dir(
        tmp_path_factory.mktemp("models"), "phi3", name="phi4-mini-small", init_std=0.1,
        max_position_embeddings=MAX_POSITIONS, rope_scaling=LONGROPE,
        extra_config={"original_max_position_embeddings": ORIGINAL}, **MINI_SHAPE)
    return folder, FullForwardReference.from_folder(folder)


def test_phi3_4k_with_its_window_equals_transformers(phi3_4k) -> None:  # noqa: ANN001
    """Plain rotary, every layer windowed; prompts shorter than and past the window, in
    prefill chunks of 16 tokens."""
    folder, ref = phi3_4k
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "phi3" and spec.rope_scaling is None
    assert spec.layer_sliding_windows == (WINDOW, WINDOW) and spec.rotary_dim == spec.head_dim
    assert set(spec.eos_token_ids) == {2, 7}
    prompts = random_prompts(1, (1, WINDOW + 1, 23, 40))
    assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)
    assert_no_leaks(llm.engine)


def test_longrope_short_factors_equal_transformers(phi4_mini) -> None:  # noqa: ANN001
    """max_model_len = original_max_position_embeddings: the short factors, transformers'
    choice for every sequence that fits; partial rotary; chunked prefill."""
    folder, ref = phi4_mini
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16,
              max_model_len=ORIGINAL)
    spec = llm.engine.spec
    assert spec.rotary_dim == 48 and spec.rope_scaling["rope_type"] == "longrope"
    assert spec.rope_scaling["attention_factor"] == pytest.approx((1 + 2 / 6) ** 0.5)  # ln4/ln64
    prompts = random_prompts(2, (1, 17, 40))
    assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)
    assert_no_leaks(llm.engine)


def test_longrope_long_factors_past_the_original_length(phi4_mini) -> None:  # noqa: ANN001
    """max_model_len past original_max_position_embeddings: the long factors, which
    transformers takes for a sequence that is longer than that from its prompt on."""
    folder, ref = phi4_mini
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == MAX_POSITIONS
    prompts = random_prompts(3, (ORIGINAL + 1, 90))
    assert_equals_reference(llm.generate(prompts, greedy(12)), prompts, ref, 12)
    # A short prompt: transformers would take the short factors, this table the long ones.
    short = random_prompts(4, (20,))
    got = llm.generate(short, greedy(1))[0].outputs[0]
    _, want = ref.greedy(short[0], 1)
    token = got.token_ids[0]
    assert abs(got.logprobs[0][token].logprob - want[0][token].item()) > 1e-3


def test_gguf_files_equal_transformers(phi3_4k, phi4_mini, tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's phi3 layout: fused attn_qkv and ffn_up (gate rows, then up), partial rotary
    as rope.dimension_count, longrope as rope_factors_long/short tensors, the window as
    attention.sliding_window. The window model, and the longrope one on both factor lists."""
    folder, ref = phi3_4k
    gguf = write_gguf_from_hf_dir(folder, tmp_path / "phi3-4k.gguf")
    assert "blk.0.attn_qkv.weight" in [t.name for t in open_gguf(gguf).tensors]
    llm = LLM(model=str(gguf), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "phi3" and spec.rope_scaling is None
    assert spec.layer_sliding_windows == (WINDOW, WINDOW)
    prompts = random_prompts(5, (WINDOW + 1, 23))
    assert_equals_reference(llm.generate(prompts, greedy(8)), prompts, ref, 8)
    assert_no_leaks(llm.engine)

    folder, ref = phi4_mini
    gguf = write_gguf_from_hf_dir(folder, tmp_path / "phi4-mini.gguf")
    for max_model_len, lengths in ((ORIGINAL, (17,)), (MAX_POSITIONS, (ORIGINAL + 1,))):
        llm = LLM(model=str(gguf), dtype="float32", block_size=4, max_num_batched_tokens=32,
                  max_model_len=max_model_len)
        spec = llm.engine.spec
        assert spec.rotary_dim == 48 and spec.rope_scaling["rope_type"] == "longrope"
        assert spec.rope_scaling["attention_factor"] == pytest.approx((1 + 2 / 6) ** 0.5)
        prompts = random_prompts(6, lengths)
        assert_equals_reference(llm.generate(prompts, greedy(8)), prompts, ref, 8)
        assert_no_leaks(llm.engine)


def test_prefix_hits_and_preemption(phi4_mini) -> None:  # noqa: ANN001
    """A shared prefix (cache hits start a chunk after it) and a KV pool too small for all
    requests (preempted ones recompute), short factors."""
    folder, ref = phi4_mini
    # Per token: 2 layers x (K, V) x 1 kv head x 64 dims x 4 bytes = 1024 bytes.
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4, max_model_len=ORIGINAL,
                       max_num_batched_tokens=8, kv_cache_memory=24 * 4 * 1024)
    shared = random_prompts(5, (14,))[0]
    prompts = [shared + tail for tail in random_prompts(6, (3, 9, 1, 12, 6))]
    check_prefix_hits_and_preemption(engine, ref, prompts, 14)


def test_bfloat16_fused_cpu_ops_stay_close(phi4_mini_small_weights) -> None:  # noqa: ANN001
    """bf16 on the CPU: the C++ rotary (partial: 48 of 64) on prompt chunks and the C++
    decode layers on decode steps."""
    folder, ref = phi4_mini_small_weights
    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4, max_num_batched_tokens=16,
              max_model_len=ORIGINAL)
    if llm.engine.model.ops != "cpu_ops" or llm.engine.model.cpu_decode is None:
        pytest.skip("the fused C++ kernels did not build here")
    prompts = random_prompts(7, (8, 30))
    agree = total = 0
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(10))):
        tokens, logprobs = ref.greedy(prompt, 10)
        seq = out.outputs[0]
        for pos, (got, want) in enumerate(zip(seq.token_ids, tokens)):
            total += 1
            agree += got == want
            assert abs(seq.logprobs[pos][got].logprob - logprobs[pos][got].item()) < 0.1
            if got != want:  # contexts differ from here on
                break
    assert agree >= total - 2  # a bf16 near-tie may flip one
    assert_no_leaks(llm.engine)


def test_int8_weights_run(phi4_mini) -> None:  # noqa: ANN001
    folder, ref = phi4_mini
    llm = LLM(model=str(folder), dtype="float32", quantization="int8", block_size=4,
              max_model_len=ORIGINAL)
    prompt = random_prompts(8, (12,))[0]
    seq = llm.generate([prompt], greedy(4))[0].outputs[0]
    assert len(seq.token_ids) == 4
    _, logprobs = ref.greedy(prompt, 1)
    token = seq.token_ids[0]
    assert abs(seq.logprobs[0][token].logprob - logprobs[0][token].item()) < 0.5
