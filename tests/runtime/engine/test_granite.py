"""Granite 3.x dense (GraniteForCausalLM: Llama with four scalar multipliers) equals
transformers' GraniteForCausalLM.

A tiny random Granite with every multiplier away from 1 (granite-3.x's are embedding 12,
residual 0.22, attention 1/128 and logits 8 at hidden 4096; here scaled to the tiny shape):
greedy tokens equal transformers' `generate(do_sample=False)` and sampled and prompt logprobs
its log-softmax (float32, 1e-4) for a batch of prompts through chunked prefill and
prefix-cache hits, and over two tensor-parallel ranks. bfloat16 declines the C++ decode layers
(they have no residual multiplier) and stays close to transformers. Omitted multipliers take
GraniteConfig's defaults (1.0: the attention scale too, not head_dim ** -0.5); the MoE and
hybrid Granite architectures, GGUF files and the rest are ValueErrors naming what.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from argosy_runtime import LLM, LLMEngine
from argosy_runtime.model_loader import ModelSpec
from engine_helpers import (
    assert_dynamic_rope_gguf_and_gptq_refused,
    random_prompts,
    record_cpp_layer_calls,
    run_requests,
)
from model_factory import (
    assert_cached_prefix_equals_transformers,
    assert_equals_transformers_generate,
    greedy_with_logprobs,
    make_random_model_dir,
)

MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.1,
                   logits_scaling=2.5)


def load_hf(folder, dtype: torch.dtype = torch.float32, **overrides):  # noqa: ANN001, ANN003, ANN201
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, **overrides).eval()



@pytest.fixture(scope="module")
def granite(tmp_path_factory):  # noqa: ANN001, ANN201
    # init_std 0.2: with the embeddings tripled, 0.5 makes one layer's output dominate.
    folder = make_random_model_dir(tmp_path_factory.mktemp("models"), "granite",
                                   num_hidden_layers=3, init_std=0.2, extra_config=MULTIPLIERS)
    return folder, load_hf(folder)


def test_multipliers_equal_transformers_generate(granite) -> None:  # noqa: ANN001
    folder, hf = granite
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "granite"
    assert {name: getattr(spec, name) for name in MULTIPLIERS} == MULTIPLIERS
    assert llm.engine.runner.backend.scale == spec.attention_scale == 0.1
    prompts = random_prompts(1, (1, 7, 23, 40))
    outputs = llm.generate(prompts, greedy_with_logprobs(16, prompt_logprobs=True))
    assert_equals_transformers_generate(outputs, prompts, hf, 16)
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 16  # not degenerate

    assert_cached_prefix_equals_transformers(llm, prompts[3][:24], hf)

    # Each multiplier matters: transformers with any one of them at 1 gives other logits.
    with torch.no_grad():
        ids = torch.tensor([prompts[2]])
        logits = hf(ids).logits
        for name in MULTIPLIERS:
            assert (load_hf(folder, **{name: 1.0})(ids).logits - logits).abs().max() > 0.1, name


def test_two_tensor_parallel_ranks_equal_transformers(granite) -> None:  # noqa: ANN001
    folder, hf = granite
    engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=2, block_size=4,
                       max_num_batched_tokens=16)
    try:
        assert engine.model.spec.num_attention_heads == 2
        prompts = random_prompts(3, (5, 30))
        outputs = run_requests(engine, [(p, greedy_with_logprobs(10)) for p in prompts])
        assert_equals_transformers_generate(outputs, prompts, hf, 10)
    finally:
        engine.shutdown()


def test_bfloat16_declines_the_cpu_decode_layers(granite, monkeypatch) -> None:  # noqa: ANN001
    """cpu_ops.decode_layer has no residual multiplier: no Granite layer may run through it.
    The module path (fused C++ norms and rotary) stays close to transformers' bfloat16."""
    folder, _ = granite
    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4)
    model = llm.engine.model
    assert model.cpu_decode is None
    assert not any(layer.cpu_decode_layer for layer in model.model.layers)
    calls = record_cpp_layer_calls(monkeypatch)
    hf = load_hf(folder, torch.bfloat16)
    prompts = random_prompts(4, (6, 17))
    agree = total = 0
    for prompt, out in zip(prompts, llm.generate(prompts, greedy_with_logprobs(6))):
        with torch.no_grad():
            ids = torch.tensor([prompt + out.outputs[0].token_ids])
            logprobs = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
        for pos, token in enumerate(out.outputs[0].token_ids):
            total += 1
            agree += token == int(logprobs[pos].argmax())
            assert abs(out.outputs[0].logprobs[pos][token].logprob - logprobs[pos, token]) < 0.15
    assert agree >= total - 1  # a bf16 near-tie may flip one
    assert calls == []


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8)


def spec_of(architecture: str = "GraniteForCausalLM", **fields) -> ModelSpec:  # noqa: ANN003
    return ModelSpec.from_hf_config({"architectures": [architecture], **SHAPE, **fields},
                                    checkpoint_dtype="float32")


def test_omitted_fields_take_the_config_class_defaults() -> None:
    """GraniteConfig's defaults: every multiplier 1.0 (so the attention scale is 1.0, not
    head_dim ** -0.5), KV heads = heads, 2048 positions, untied, token ids 1 and 2."""
    hf = transformers.AutoConfig.for_model("granite", **SHAPE)
    ours = spec_of()
    for name in MULTIPLIERS:
        assert getattr(ours, name) == getattr(hf, name) == 1.0, name
    assert ours.attention_scale == hf.attention_multiplier
    assert ours.embedding_scale is None
    assert ours.num_key_value_heads == hf.num_key_value_heads == 8
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings is hf.tie_word_embeddings is False
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    # GraniteConfig has no sliding window: one in config.json does nothing in transformers.
    assert spec_of(sliding_window=8).layer_sliding_windows == ()


@pytest.mark.parametrize("architecture,fields,match", [
    # the MoE and hybrid variants are other architectures
    ("GraniteMoeForCausalLM", {}, "unsupported architecture 'GraniteMoeForCausalLM'"),
    ("GraniteMoeSharedForCausalLM", {}, "unsupported architecture 'GraniteMoeSharedForCausalLM'"),
    ("GraniteMoeHybridForCausalLM", {}, "unsupported architecture 'GraniteMoeHybridForCausalLM'"),
    ("GraniteForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("GraniteForCausalLM", {"logits_scaling": 0}, "logits_scaling must be a positive"),
    ("GraniteForCausalLM", {"attention_multiplier": "0.1"}, "attention_multiplier must be a number"),
    ("GraniteForCausalLM", {"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_config_is_a_value_error(architecture: str, fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec_of(architecture, **fields)
    if not fields:  # also when config.json names only its model_type
        model_type = {"GraniteMoeForCausalLM": "granitemoe", "GraniteMoeSharedForCausalLM":
                      "granitemoeshared", "GraniteMoeHybridForCausalLM": "granitemoehybrid"}
        with pytest.raises(ValueError, match="unsupported architecture"):
            ModelSpec.from_hf_config({"model_type": model_type[architecture], **SHAPE},
                                     checkpoint_dtype="float32")


def test_unsupported_rope_scaling_gguf_and_gptq_are_value_errors(granite, tmp_path) -> None:  # noqa: ANN001
    folder, _ = granite
    assert_dynamic_rope_gguf_and_gptq_refused(folder, "granite", tmp_path)