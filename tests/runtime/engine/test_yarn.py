"""YaRN rope scaling (Qwen2.5 / Qwen3 model cards' long context, SmolLM3's 128k, llama.cpp's
`rope.scaling.type = yarn`) as transformers computes it: the tables themselves against
`_compute_yarn_parameters`, tiny random models against transformers end to end (prompts
and continuations past `original_max_position_embeddings`), the bf16 C++ decode layers
against the module path, and a GGUF file with llama.cpp's yarn keys against its HF folder."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from argosy_runtime import LLM, SamplingParams
from argosy_runtime.model_loader.model_spec import ModelSpec
from argosy_runtime.models.rotary import rope_inv_freq
from engine_helpers import record_cpp_layer_calls  # tests/runtime, on sys.path via conftest.py
from model_factory import QWEN3_TEST_SHAPE, make_random_model_dir, write_gguf_from_hf_dir
from test_config_variants import assert_equals_transformers, edit_config
from transformers.modeling_rope_utils import _compute_yarn_parameters

# Qwen2.5's model card fields, scaled down so a short prompt runs past the original length.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# Every optional field transformers reads (mscale / mscale_all_dim: the attention factor).
YARN_ALL = {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 1.0,
            "mscale_all_dim": 0.5}


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 1e6), (32, 5000.0)])
@pytest.mark.parametrize("fields", [
    {"factor": 4.0, "original_max_position_embeddings": 32},
    {"factor": 4, "original_max_position_embeddings": 32768},  # Qwen2.5 / Qwen3's card
    {"factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    {"factor": 8.0, "original_max_position_embeddings": 32, "truncate": False},
    {"factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 0.8},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 1.0},
    {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707},  # alone: unused
    {"factor": 1.0, "original_max_position_embeddings": 32},
    {"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 4, "beta_slow": 4,
     "truncate": False},  # an empty ramp (transformers adds 0.001)
    {"factor": None, "original_max_position_embeddings": 512},  # max_position / original
    {"factor": 4.0},  # original: max_position_embeddings
])
def test_yarn_table_equals_transformers(fields: dict, head_dim: int, theta: float) -> None:
    config = dict(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                  max_position_embeddings=2048, intermediate_size=64, num_hidden_layers=1,
                  vocab_size=128,
                  rope_parameters={"rope_type": "yarn", "rope_theta": theta, **fields})
    # (transformers fills the rope dict it is given in place: a copy)
    expected, expected_factor = _compute_yarn_parameters(
        transformers.LlamaConfig(**copy.deepcopy(config)))
    spec = ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], **config},
                                    checkpoint_dtype="float32")
    inv_freq, attention_factor = rope_inv_freq(spec.rotary_dim, spec.rope_theta,
                                               spec.rope_scaling)
    assert torch.equal(inv_freq, expected)
    assert attention_factor == expected_factor


def assert_yarn_equals_transformers(folder: Path, hf_reference, model: str | None = None  # noqa: ANN001
                                    ) -> None:
    """28 prompt tokens and 6 more: past the original length 16. (The config is checked to
    say yarn: a default rope on both sides would pass too.)"""
    config = json.loads((folder / "config.json").read_text())
    assert ModelSpec.from_hf_config(config, checkpoint_dtype="float32").rope_scaling[
        "rope_type"] == "yarn"
    assert_equals_transformers(folder, hf_reference, prompt_len=28, model=model)


def _yarn_config(layout: str, yarn: dict) -> dict:
    """The config fields of `yarn` in each layout transformers reads: 5.x `rope_parameters`
    or 4.x `rope_theta` + `rope_scaling` (`type`). (The model cards' rope_scaling added
    beside rope_parameters: test_config_variants.py.)"""
    if layout == "rope_parameters":
        return {"rope_parameters": {**yarn, "rope_theta": 5000.0}}
    legacy = {"type": "yarn", **{k: v for k, v in yarn.items() if k != "rope_type"}}
    return {"rope_parameters": None, "rope_theta": 5000.0, "rope_scaling": legacy}


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("yarn", [YARN, YARN_ALL], ids=["minimal", "all-fields"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_yarn_equals_transformers(arch: str, yarn: dict, layout: str, tmp_path,
                                  hf_reference) -> None:  # noqa: ANN001
    folder = make_random_model_dir(tmp_path, arch, num_hidden_layers=1)
    edit_config(folder, lambda config: config.update(_yarn_config(layout, yarn)))
    assert_yarn_equals_transformers(folder, hf_reference)


@pytest.mark.parametrize("arch,yarn", [
    ("qwen3", {**YARN, "attention_factor": 1.3}),
    # SmolLM3-3B's own config says `type` (its NoPE layers: no rotary to scale)
    ("smollm3", {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}),
    # transformers' yarn reads truncate from the top of Gemma 3's per-layer-type
    # rope_parameters, so a full-attention dict's truncate: false changes nothing.
    ("gemma3", {**YARN, "truncate": False}),
])
def test_yarn_other_architectures_equal_transformers(arch: str, yarn: dict, tmp_path,
                                                     hf_reference) -> None:  # noqa: ANN001
    if arch == "qwen3":
        folder = make_random_model_dir(tmp_path, "qwen3", **QWEN3_TEST_SHAPE,
                                       rope_scaling=yarn)
    elif arch == "smollm3":  # (SmolLM3Config's pad_token_id lies outside the test vocabulary)
        folder = make_random_model_dir(tmp_path, "smollm3", tie_word_embeddings=True,
                                       extra_config={"no_rope_layers": [1, 0],
                                                     "pad_token_id": None})
        edit_config(folder, lambda config: config.update(rope_scaling=yarn))
    else:  # its full-attention layers take the scaling, the sliding ones their own base
        folder = make_random_model_dir(
            tmp_path, "gemma3", num_hidden_layers=2, head_dim=32, init_std=0.15,
            tie_word_embeddings=True, extra_config=dict(
                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {**yarn, "rope_theta": 5e3},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 100.0}}))
    assert_yarn_equals_transformers(folder, hf_reference)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler: the fused kernels are off")
def test_yarn_bf16_cpu_decode_layers_equal_the_module_path(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The C++ decode layers (models/cpu_decode.py) read the same scaled cos/sin tables."""
    folder = make_random_model_dir(tmp_path, "qwen2", num_hidden_layers=2,
                                   rope_scaling=YARN_ALL)
    llm = LLM(model=str(folder), dtype="bfloat16", kv_cache_memory=8 << 20, block_size=4,
              enable_prefix_caching=False)
    model = llm.engine.model
    assert model.cpu_decode is not None
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (20, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)

    def generate() -> list:
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]

    calls = record_cpp_layer_calls(monkeypatch)
    fast = generate()
    assert calls, "decode steps took the C++ path"
    model.cpu_decode = None
    assert generate() == fast


def test_gguf_with_llama_cpps_yarn_keys_equals_its_hf_folder(tmp_path, hf_reference,
                                                             monkeypatch) -> None:  # noqa: ANN001
    """The keys convert_hf_to_gguf.py writes for a yarn rope_parameters: type, factor,
    original context, and attention_factor / beta_fast / beta_slow as yarn_attn_factor /
    yarn_beta_fast / yarn_beta_slow. (model_factory's writer adds no rope scaling but
    Gemma 3's linear: here its GGUFWriter gets them alongside the rope base.)"""
    from gguf import GGUFWriter, RopeScalingType

    yarn = {**YARN, "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0}
    folder = make_random_model_dir(tmp_path, "llama", num_hidden_layers=1, rope_scaling=yarn)
    add_rope_freq_base = GGUFWriter.add_rope_freq_base

    def with_yarn_keys(writer: GGUFWriter, value: float) -> None:
        add_rope_freq_base(writer, value)
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_attn_factor(yarn["attention_factor"])
        writer.add_rope_scaling_yarn_beta_fast(yarn["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(yarn["beta_slow"])

    monkeypatch.setattr(GGUFWriter, "add_rope_freq_base", with_yarn_keys)
    gguf = write_gguf_from_hf_dir(folder, tmp_path / "yarn.gguf")
    assert_yarn_equals_transformers(folder, hf_reference, model=str(gguf))


def _tiny_gguf_rope_scaling(path: Path, **keys: float) -> dict:
    from argosy_runtime.model_loader.gguf_checkpoint import spec_from_gguf
    from argosy_runtime.model_loader.gguf_metadata import open_gguf
    from gguf import RopeScalingType
    from model_factory import write_tiny_gguf

    def yarn(writer) -> None:  # noqa: ANN001
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        for key, value in keys.items():
            writer.add_float32(f"qwen2.rope.scaling.{key}", value)

    write_tiny_gguf(path, "qwen2", context=256, extra=yarn)
    return spec_from_gguf(open_gguf(path)).rope_scaling


def test_gguf_yarn_defaults_and_refusals(tmp_path: Path) -> None:
    # No original context: the context length (llama.cpp's n_ctx_orig_yarn default too).
    assert _tiny_gguf_rope_scaling(tmp_path / "a.gguf") == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert _tiny_gguf_rope_scaling(tmp_path / "b.gguf", yarn_ext_factor=1.0)["factor"] == 4.0
    # ext_factor weighs the ramp: transformers' yarn has none to give it.
    with pytest.raises(ValueError, match="yarn_ext_factor 0.5 is not supported"):
        _tiny_gguf_rope_scaling(tmp_path / "c.gguf", yarn_ext_factor=0.5)


@pytest.mark.parametrize("fields,match", [
    ({"rope_type": "yarn", "original_max_position_embeddings": 16}, "yarn rope scaling needs 'factor'"),
    ({**YARN, "factor": 0.0}, "factor must be positive"),
    ({**YARN, "beta_fast": "32"}, "beta_fast must be a number"),
])
def test_bad_yarn_config_is_a_value_error(fields: dict, match: str) -> None:
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 128,
              "rope_scaling": fields}
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(config, checkpoint_dtype="float32")
