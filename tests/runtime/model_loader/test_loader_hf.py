"""HF safetensors folders: tensors and spec against transformers; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint


def _transformers_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")


@pytest.mark.parametrize("fixture", ["random_llama_dir", "random_qwen2_dir", "random_sharded_dir"])
def test_weights_and_spec_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    model = _transformers_model(folder)
    config = model.config
    reference = model.state_dict()
    ckpt = load_checkpoint(str(folder))
    spec = ckpt.spec
    assert ckpt.format == "hf" and ckpt.path == folder

    ours = dict(ckpt.iter_weights())
    expected_names = set(reference)
    if config.tie_word_embeddings:
        expected_names.discard("lm_head.weight")
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        assert tensor.dtype == reference[name].dtype, name
        assert torch.equal(tensor, reference[name]), name

    assert spec.architecture == config.model_type
    assert spec.vocab_size == config.vocab_size
    assert spec.hidden_size == config.hidden_size
    assert spec.intermediate_size == config.intermediate_size
    assert spec.num_hidden_layers == config.num_hidden_layers
    assert spec.num_attention_heads == config.num_attention_heads
    assert spec.num_key_value_heads == config.num_key_value_heads
    assert spec.head_dim == config.hidden_size // config.num_attention_heads
    assert spec.rms_norm_eps == config.rms_norm_eps
    assert spec.rope_theta == config.rope_parameters["rope_theta"]
    assert spec.rope_scaling is None
    assert spec.max_position_embeddings == config.max_position_embeddings
    assert spec.tie_word_embeddings == config.tie_word_embeddings
    assert spec.bos_token_id == config.bos_token_id
    assert spec.checkpoint_dtype == str(reference["model.norm.weight"].dtype).removeprefix("torch.")
    # q/k/v biases exist exactly when the architecture has them (Qwen2).
    has_bias = "model.layers.0.self_attn.q_proj.bias" in reference
    assert spec.attention_bias == has_bias == (config.model_type == "qwen2")


def test_sharded_folder_really_is_sharded(random_sharded_dir: Path) -> None:
    index = json.loads((random_sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert not (random_sharded_dir / "model.safetensors").exists()


def test_eos_ids_from_config_and_generation_config(random_sharded_dir: Path, tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(random_sharded_dir))
    assert ckpt.spec.eos_token_ids == (2, 0)
    folder = tmp_path / "copy"
    shutil.copytree(random_sharded_dir, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 7]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    ckpt = load_checkpoint(str(folder))
    assert ckpt.spec.eos_token_ids == (2, 0, 7)
    assert set(ckpt.tokenizer.eos_token_ids) == {2, 0, 7}
    assert ckpt.tokenizer.eos_token_id == 2  # <|im_end|>, the tokenizer's own eos_token


def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / folder.name
    shutil.copytree(folder, dest)
    return dest


def test_missing_folder() -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_checkpoint("/nonexistent/does-not-exist")


def test_missing_config(random_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(folder))


def test_missing_weights(random_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(str(folder))


def test_missing_shard(random_sharded_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_sharded_dir, tmp_path)
    shard = sorted(folder.glob("model-0000*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint(str(folder))


def test_unknown_architecture(random_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    config["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as info:
        load_checkpoint(str(folder))
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in str(info.value)


def test_config_missing_a_field(random_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_checkpoint(str(folder))


def test_checkpoint_not_matching_config(random_llama_dir: Path, tmp_path: Path) -> None:
    """A config that claims more layers than the weights hold fails when iterating, naming a weight."""
    folder = _copy(random_llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(str(folder))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.2\."):
        list(ckpt.iter_weights())


def test_mistral_folder(tmp_path: Path) -> None:
    from model_factory import make_random_model_dir

    folder = make_random_model_dir(tmp_path, "mistral", num_hidden_layers=1, head_dim=32)
    ckpt = load_checkpoint(str(folder))
    assert ckpt.spec.architecture == "mistral"
    assert ckpt.spec.head_dim == 32  # explicit head_dim != hidden / heads (64 / 4)
    weights = dict(ckpt.iter_weights())
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
