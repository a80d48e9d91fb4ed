"""GGUF files with metadata of the wrong type, errors naming the file, and the file's mapping
released once the weights are read."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from gguf import GGUFValueType, GGUFWriter
from model_factory import write_tiny_gguf

T = GGUFValueType


def _write(path: Path, override: dict[str, tuple[Any, GGUFValueType]]) -> Path:
    """A minimal llama GGUF (as write_tiny_gguf) whose fields `override` replaces, types and all."""
    fields: dict[str, tuple[Any, GGUFValueType]] = {
        "llama.context_length": (64, T.UINT32), "llama.embedding_length": (8, T.UINT32),
        "llama.block_count": (1, T.UINT32), "llama.feed_forward_length": (16, T.UINT32),
        "llama.attention.head_count": (2, T.UINT32),
        "llama.attention.head_count_kv": (1, T.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", T.STRING),
        "tokenizer.ggml.tokens": (["a", "b", "ab"], T.ARRAY),
        "tokenizer.ggml.merges": (["a b"], T.ARRAY),
        "tokenizer.ggml.token_type": ([1, 1, 1], T.ARRAY),
        **override,
    }
    writer = GGUFWriter(str(path), "llama")
    for key, (value, value_type) in fields.items():
        if value_type == T.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, value_type)
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("llama.block_count", ([1], T.ARRAY), "an integer"),  # TypeError from int(list) before
    ("llama.attention.head_count", (2.5, T.FLOAT32), "an integer"),  # silently 2 before
    ("llama.embedding_length", ("8", T.STRING), "an integer"),
    ("llama.attention.layer_norm_rms_epsilon", ("x", T.STRING), "a number"),
    ("tokenizer.ggml.eos_token_id", ("2", T.STRING), "an integer"),  # TypeError before
    ("tokenizer.ggml.bos_token_id", ([1], T.ARRAY), "an integer"),  # TypeError before
    ("tokenizer.ggml.tokens", ([1, 2, 3], T.ARRAY), "an array of strings"),  # TypeError
    ("tokenizer.ggml.merges", ([1], T.ARRAY), "an array of strings"),  # AttributeError
    ("tokenizer.ggml.token_type", (["x", "y", "z"], T.ARRAY), "an array of integers"),
    ("tokenizer.ggml.add_bos_token", ("yes", T.STRING), "a bool"),
    ("tokenizer.chat_template", (1, T.UINT32), "a string"),
])
def test_gguf_metadata_of_wrong_type(tmp_path: Path, key: str, value: tuple, expected: str
                                     ) -> None:
    path = _write(tmp_path / "typed.gguf", {key: value})
    with pytest.raises(ValueError, match=rf"typed\.gguf: GGUF metadata '{key}' must be {expected}"):
        load_checkpoint(path)


def test_gguf_spec_errors_name_the_file(tmp_path: Path) -> None:
    """The spec's own checks (here: a context length of 0) said nothing of the file."""
    path = _write(tmp_path / "ctx0.gguf", {"llama.context_length": (0, T.UINT32)})
    with pytest.raises(ValueError, match=r"ctx0\.gguf: .*max_position_embeddings"):
        load_checkpoint(path)


def _mappings(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith(str(path.resolve()))]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc")
def test_gguf_file_not_kept_mapped_after_the_weights_are_read(tmp_path: Path) -> None:
    """The engine keeps its Checkpoint for its whole life; the checkpoint kept the GGUFReader's
    memory map of the whole file, so a served model held the file (and its disk space once
    deleted) mapped forever."""
    path = write_tiny_gguf(tmp_path / "mapped.gguf", "llama")
    ckpt = load_checkpoint(path)
    assert _mappings(path)  # the reader load_checkpoint parsed, for the first pass
    first = dict(ckpt.iter_weights())
    gc.collect()
    assert not _mappings(path)
    # A second pass (a self-draft model) opens the file again and reads the same tensors.
    again = dict(ckpt.iter_weights())
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert ckpt.gguf_rope_heads("model.layers.0.self_attn.q_proj.weight") == 2
    assert ckpt.gguf_rope_heads("model.layers.0.self_attn.k_proj.weight") == 1
    del again
    gc.collect()
    assert not _mappings(path)


@pytest.mark.parametrize(("array", "message"), [
    # q rows that are not heads x an even head_dim: numpy's bare "cannot reshape array" before
    (np.zeros((7, 8), dtype=np.float32),
     r"GGUF tensor blk\.0\.attn_q\.weight of shape \(7, 8\): its 7 rows do not split into 2 heads"),
    (np.zeros((8, 8), dtype=np.float64), r"GGUF tensor blk\.0\.attn_q\.weight: type F64 is not supported"),
])
def test_gguf_tensor_errors_name_the_file_and_the_tensor(tmp_path: Path, array: np.ndarray,
                                                         message: str) -> None:
    path = write_tiny_gguf(tmp_path / "bad-tensor.gguf", "llama",
                           extra=lambda writer: writer.add_tensor("blk.0.attn_q.weight", array))
    ckpt = load_checkpoint(path)
    with pytest.raises(ValueError, match=r"bad-tensor\.gguf: " + message):
        list(ckpt.iter_weights())


@pytest.mark.parametrize("merges", [["ab"], ["x y"]])  # not two tokens; tokens not in the list
def test_gguf_tokenizer_the_library_rejects(tmp_path: Path, merges: list[str]) -> None:
    """The tokenizers library's own TypeError / plain Exception escaped load_checkpoint."""
    path = _write(tmp_path / "merges.gguf", {"tokenizer.ggml.merges": (merges, T.ARRAY)})
    with pytest.raises(ValueError, match=r"merges\.gguf: cannot build the tokenizer"):
        load_checkpoint(path)


@pytest.mark.parametrize(("fields", "expected"), [
    # 2023 converters: the factor as rope.scale_linear, no scaling.type (llama.cpp: linear).
    # It was ignored: a 16k linear-scaled model (Vicuna-16k, LongChat) served unscaled.
    ({"llama.rope.scale_linear": (4.0, T.FLOAT32)}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.factor": (2.0, T.FLOAT32)}, {"rope_type": "linear", "factor": 2.0}),
    # llama.cpp: a factor of 0 (or none) is no scaling. It divided the frequencies by 0 (linear)
    # or was a missing-field error (yarn).
    ({"llama.rope.scaling.type": ("linear", T.STRING), "llama.rope.scaling.factor": (0.0, T.FLOAT32)},
     None),
    ({"llama.rope.scaling.type": ("yarn", T.STRING)},
     {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 64}),
    ({"llama.rope.scaling.type": ("none", T.STRING), "llama.rope.scaling.factor": (4.0, T.FLOAT32)},
     None),
    ({"llama.rope.scaling.type": ("linear", T.STRING), "llama.rope.scaling.factor": (4.0, T.FLOAT32)},
     {"rope_type": "linear", "factor": 4.0}),
])
def test_gguf_rope_scaling_as_llama_cpp_reads_it(tmp_path: Path, fields: dict,
                                                 expected: dict | None) -> None:
    assert load_checkpoint(_write(tmp_path / "rope.gguf", fields)).spec.rope_scaling == expected


def test_gguf_negative_rope_scaling_factor(tmp_path: Path) -> None:
    path = _write(tmp_path / "neg.gguf", {"llama.rope.scaling.type": ("linear", T.STRING),
                                          "llama.rope.scaling.factor": (-2.0, T.FLOAT32)})
    with pytest.raises(ValueError, match=r"neg\.gguf: GGUF llama\.rope\.scaling\.factor must be positive"):
        load_checkpoint(path)


@pytest.mark.parametrize(("model", "key", "value"), [
    ("gpt2", "tokenizer.ggml.token_type", [1]),
    ("llama", "tokenizer.ggml.scores", [0.0]),
    ("llama", "tokenizer.ggml.token_type", [2]),
])
def test_gguf_tokenizer_arrays_shorter_than_the_tokens(tmp_path: Path, model: str, key: str,
                                                      value: list) -> None:
    """Scores / token types are paired with tokens by position: a short array loaded, with
    merges silently dropped or control tokens unmarked."""
    fields: dict[str, tuple[Any, GGUFValueType]] = {key: (value, T.ARRAY)}
    if model == "llama":  # sentencepiece: scores, no merges
        fields = {"tokenizer.ggml.model": ("llama", T.STRING),
                  "tokenizer.ggml.scores": ([0.0, 0.0, -1.0], T.ARRAY),
                  "tokenizer.ggml.token_type": ([2, 1, 1], T.ARRAY), **fields}
    path = _write(tmp_path / "short.gguf", fields)
    with pytest.raises(ValueError, match=rf"short\.gguf: GGUF metadata '{key}' has 1 entries for 3 tokens"):
        load_checkpoint(path)
