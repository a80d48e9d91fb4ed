"""Checkpoints whose config.json leans on transformers' reading of it give transformers'
outputs (float32 logprobs of every prompt position and greedy tokens): fields left to the
config class's defaults (a Mixtral without rope_theta / rms_norm_eps: base 1e6, eps 1e-5), and
a `rope_scaling` added next to a transformers 5 `rope_parameters` (it wins there: linear, and
yarn as Qwen2.5's model card adds it; tests/runtime/engine/test_yarn.py covers yarn). The
config parsing itself is tests/runtime/model_loader/test_loader_config_defaults.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from argosy_runtime import LLM, SamplingParams
from model_factory import edit_config, make_random_model_dir


def assert_equals_transformers(folder: Path, hf_reference, prompt_len: int = 24,  # noqa: ANN001
                               model: str | None = None) -> None:
    """`model` (default: the folder) served by us gives transformers' outputs of `folder`."""
    hf = hf_reference(folder)
    llm = LLM(model=model or str(folder), dtype="float32", block_size=4)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 49152) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    [out] = llm.generate([prompt], params)
    expected = hf.prompt_logprobs(prompt)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(
            expected[i - 1][prompt[i]].item(), abs=1e-4), i
    assert out.outputs[0].token_ids == hf.greedy(prompt, 6)


def test_mixtral_without_rope_theta_and_eps_uses_the_class_defaults(tmp_path, hf_reference) -> None:  # noqa: ANN001
    def drop(config: dict) -> None:
        config.pop("rms_norm_eps")
        config["rope_parameters"].pop("rope_theta")

    folder = make_random_model_dir(tmp_path, "mixtral", rms_norm_eps=1e-2, extra_config=dict(
        num_local_experts=4, num_experts_per_tok=2))
    assert_equals_transformers(edit_config(folder, drop), hf_reference)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rope_scaling_added_to_rope_parameters_applies(arch: str, tmp_path, hf_reference) -> None:  # noqa: ANN001
    def add(config: dict) -> None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}

    if arch == "gemma3":  # its full-attention layers take the scaling, as transformers'
        folder = make_random_model_dir(
            tmp_path, "gemma3", num_hidden_layers=2, head_dim=32, init_std=0.15,
            tie_word_embeddings=True, extra_config=dict(
                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e3},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 100.0}}))
    else:
        folder = make_random_model_dir(tmp_path, arch, rope_theta=5000.0)
    assert_equals_transformers(edit_config(folder, add), hf_reference)


def test_model_card_yarn_beside_rope_parameters_applies(tmp_path, hf_reference) -> None:  # noqa: ANN001
    # Qwen2.5's model card: add this to config.json for long prompts (4.x style: `type`). In a
    # 5.x config beside rope_parameters it applies in transformers, and so here (it was once
    # refused). Original length 16: the prompt and its continuation run past it.
    folder = make_random_model_dir(tmp_path, "qwen2", rope_theta=5000.0)
    edit_config(folder, lambda config: config.update(rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}))
    assert_equals_transformers(folder, hf_reference)


@pytest.mark.parametrize("key,scaling", [
    # Serving a scaled model unscaled would be silently wrong: refused, in either layout.
    ("rope_scaling", {"type": "dynamic", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
])
def test_unsupported_rope_scaling_is_refused(key: str, scaling: dict, tmp_path) -> None:  # noqa: ANN001
    folder = make_random_model_dir(tmp_path, "qwen2", num_hidden_layers=1)
    edit_config(folder, lambda config: config.update({key: scaling}))
    kind = scaling.get("rope_type") or scaling["type"]
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported"):
        LLM(model=str(folder), dtype="float32", block_size=4)


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_attention_bias_where_transformers_has_none_is_ignored(arch: str, tmp_path,
                                                               hf_reference) -> None:  # noqa: ANN001
    # Mistral's, Mixtral's and Phi-3's attention has no bias whatever the config says: the
    # load looked for q/k/v bias tensors the checkpoint (as transformers writes it) lacks.
    folder = make_random_model_dir(tmp_path, arch, num_hidden_layers=1)
    assert_equals_transformers(edit_config(folder, lambda c: c.update(attention_bias=True)),
                               hf_reference)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_attention_bias_on_o_proj_is_refused(arch: str, tmp_path) -> None:  # noqa: ANN001
    # transformers biases o_proj too there: the load failed naming only the o_proj.bias tensor.
    folder = make_random_model_dir(tmp_path, arch, num_hidden_layers=1)
    edit_config(folder, lambda c: c.update(attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias=true is not supported for .*o_proj"):
        LLM(model=str(folder), dtype="float32", block_size=4)
