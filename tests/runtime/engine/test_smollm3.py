"""SmolLM3 (SmolLM3ForCausalLM: Llama whose NoPE layers apply no rotary embedding) equals
transformers' SmolLM3ForCausalLM.

A tiny random SmolLM3 with `no_rope_layers` [1, 0, 1, 0] (layers 1 and 3 NoPE) and tied
embeddings (SmolLM3's default): greedy tokens equal transformers' `generate(do_sample=False)`
and sampled and prompt logprobs its log-softmax (float32, 1e-4) for a batch of prompts through
chunked prefill and prefix-cache hits; the same with SmolLM3's optional sliding window (on the
NoPE layers), over two tensor-parallel ranks, and in bfloat16 the C++ decode layers (NoPE
layers rotated by the identity) equal the module path token for token. Omitted config fields
take SmolLM3Config's defaults; what is not supported is a ValueError naming it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from argosy_runtime import LLM, LLMEngine
from argosy_runtime.model_loader import ModelSpec
from engine_helpers import (
    assert_dynamic_rope_gguf_and_gptq_refused,
    assert_no_leaks,
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

NO_ROPE_LAYERS = [1, 0, 1, 0]  # 1: rotary; layers 1 and 3 are NoPE
WINDOW = 8
# SmolLM3Config's pad_token_id (128004) lies outside the test vocabulary.
SMOLLM3 = dict(num_hidden_layers=4, tie_word_embeddings=True)


def smollm3_dir(tmp_path, name: str, **extra):  # noqa: ANN001, ANN003, ANN201
    return make_random_model_dir(tmp_path, "smollm3", name=name, **SMOLLM3, extra_config={
        "no_rope_layers": NO_ROPE_LAYERS, "pad_token_id": None, **extra})


def load_hf(folder, **overrides):  # noqa: ANN001, ANN003, ANN201
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **overrides).eval()



@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = smollm3_dir(tmp_path_factory.mktemp("models"), "smollm3")
    return folder, load_hf(folder)


def test_nope_layers_equal_transformers_generate(smollm3) -> None:  # noqa: ANN001
    """A batch of prompts (1 to 40 tokens, prefill chunks of 16, 20 new tokens: every position
    through both NoPE and rotary layers), then prompts sharing a cached prefix."""
    folder, hf = smollm3
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "smollm3" and spec.nope_layers == (1, 3)
    assert spec.tie_word_embeddings and spec.layer_sliding_windows == ()
    assert [layer.self_attn.use_rope for layer in llm.engine.model.model.layers] == [
        True, False, True, False]
    prompts = random_prompts(1, (1, 7, 23, 40))
    outputs = llm.generate(prompts, greedy_with_logprobs(20, prompt_logprobs=True))
    assert_equals_transformers_generate(outputs, prompts, hf, 20)
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 20  # not degenerate

    assert_cached_prefix_equals_transformers(llm, prompts[3][:24], hf)

    # The NoPE layers matter: rotating them too gives transformers other logits.
    rotated = load_hf(folder, no_rope_layers=[1, 1, 1, 1])
    with torch.no_grad():
        ids = torch.tensor([prompts[2]])
        assert (hf(ids).logits - rotated(ids).logits).abs().max() > 0.1


def test_sliding_window_on_the_nope_layers(tmp_path) -> None:  # noqa: ANN001
    """use_sliding_window with a window: SmolLM3Config slides the NoPE layers; prompts shorter
    than, equal to and past the window."""
    folder = smollm3_dir(tmp_path, "smollm3-window", use_sliding_window=True,
                         sliding_window=WINDOW)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.spec.layer_sliding_windows == (None, WINDOW, None, WINDOW)
    prompts = random_prompts(3, (1, WINDOW, WINDOW + 1, 23))
    assert_equals_transformers_generate(llm.generate(prompts, greedy_with_logprobs(12)), prompts,
                                        load_hf(folder), 12)
    assert_no_leaks(llm.engine)


def test_two_tensor_parallel_ranks_equal_transformers(smollm3) -> None:  # noqa: ANN001
    folder, hf = smollm3
    engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=2, block_size=4,
                       max_num_batched_tokens=16)
    try:
        assert engine.model.spec.num_attention_heads == 2 and engine.model.spec.nope_layers == (1, 3)
        prompts = random_prompts(4, (5, 30))
        outputs = run_requests(engine, [(p, greedy_with_logprobs(10)) for p in prompts])
        assert_equals_transformers_generate(outputs, prompts, hf, 10)
    finally:
        engine.shutdown()


def test_bfloat16_cpu_decode_layers_equal_the_module_path(smollm3, monkeypatch) -> None:  # noqa: ANN001
    """The C++ decode layers run SmolLM3 (the NoPE layers through the identity rotation) and
    give the module path's tokens and logprobs exactly."""
    folder, _ = smollm3
    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4, enable_prefix_caching=False)
    model = llm.engine.model
    if model.cpu_decode is None:
        pytest.skip("the fused C++ kernels did not build here")
    assert model.cpu_decode.rope_layers == [True, False, True, False]
    prompts = random_prompts(5, (6, 17, 30))
    params = [greedy_with_logprobs(n) for n in (12, 5, 9)]

    def run() -> list:
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]

    calls = record_cpp_layer_calls(monkeypatch)
    fast = run()
    assert sorted(set(calls)) == [1, 2, 3], "decode steps of 3, 2 and 1 sequences took the C++ path"
    model.cpu_decode = None
    assert run() == fast


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
             num_attention_heads=8)


@pytest.mark.parametrize("fields", [
    {}, {"no_rope_layer_interval": 3}, {"use_sliding_window": True, "sliding_window": 16},
    {"no_rope_layers": [0, 1, 1, 1, 1, 1, 0, 1, 1], "use_sliding_window": True,
     "sliding_window": 16},
], ids=["defaults", "interval", "window", "listed"])
def test_omitted_fields_take_the_config_class_defaults(fields: dict) -> None:
    """Every expectation is transformers' own SmolLM3Config for the same dict: 4 KV heads,
    tied embeddings, rope base 2e6, 32768 positions, Llama 3's token ids, a NoPE layer every
    no_rope_layer_interval (4) layers, the NoPE layers sliding when a window is on."""
    config = {**SHAPE, **fields}
    hf = transformers.AutoConfig.for_model("smollm3", **config)
    ours = ModelSpec.from_hf_config({"architectures": ["SmolLM3ForCausalLM"], **config},
                                    checkpoint_dtype="float32")
    assert ours.num_key_value_heads == hf.num_key_value_heads == 4
    assert ours.tie_word_embeddings is hf.tie_word_embeddings is True
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rms_norm_eps == hf.rms_norm_eps and ours.attention_bias is hf.attention_bias
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    assert ours.nope_layers == tuple(i for i in range(8) if not hf.no_rope_layers[i])
    assert ours.nope_layers  # every case has some
    windows = list(ours.layer_sliding_windows) or [None] * 8
    assert windows == [hf.sliding_window if t == "sliding_attention" else None
                       for t in hf.layer_types]
    assert ours.attention_scale == 8 ** -0.5  # head_dim 64 / 8


def spec_of(**fields) -> ModelSpec:  # noqa: ANN003
    return ModelSpec.from_hf_config({"architectures": ["SmolLM3ForCausalLM"], **SHAPE, **fields},
                                    checkpoint_dtype="float32")


@pytest.mark.parametrize("fields,match", [
    ({"attention_bias": True}, "attention_bias"),
    ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers"),  # shorter than the 8 layers
    ({"no_rope_layers": [1, 2, 1, 1, 1, 1, 1, 1]}, "no_rope_layers"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    # the mask would slide these layers, flash attention would not
    ({"layer_types": ["sliding_attention"] * 8, "sliding_window": 16}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 8, "use_sliding_window": True}, "sliding_window"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_config_is_a_value_error(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec_of(**fields)


def test_unsupported_rope_scaling_gguf_and_gptq_are_value_errors(smollm3, tmp_path) -> None:  # noqa: ANN001
    folder, _ = smollm3
    assert_dynamic_rope_gguf_and_gptq_refused(folder, "smollm3", tmp_path)