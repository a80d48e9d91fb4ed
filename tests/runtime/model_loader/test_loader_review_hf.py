"""Hugging Face folders: errors that name the file and the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from argosy_runtime.model_loader import load_checkpoint


def test_missing_shard_names_its_tensors(random_sharded_dir: Path, tmp_path: Path) -> None:
    """The index says which tensors the missing shard holds: the error lists some of them."""
    folder = tmp_path / random_sharded_dir.name
    shutil.copytree(random_sharded_dir, folder)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    tensor = next(name for name, file in weight_map.items() if file == shard)
    (folder / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard}.*missing.*{tensor}"):
        load_checkpoint(folder)


def test_folder_without_safetensors_says_what_it_holds(random_llama_dir: Path,
                                                        tmp_path: Path) -> None:
    """A GGUF repo's folder often has a config.json too (TheBloke's: {"model_type": "llama"}),
    so it resolves as a Hugging Face folder: the error pointed at safetensors alone."""
    folder = tmp_path / "gguf-repo"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "llama-2-7b.Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"llama-2-7b\.Q4_K_M\.gguf: pass the \.gguf file"):
        load_checkpoint(folder)
    # Shards whose index was not downloaded.
    folder = tmp_path / "no-index"
    shutil.copytree(random_llama_dir, folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    with pytest.raises(FileNotFoundError,
                       match=r"model-00001-of-00001\.safetensors without model\.safetensors\.index"):
        load_checkpoint(folder)


def test_folder_of_one_gguf_in_upper_case(tmp_path: Path) -> None:
    """A .GGUF file path loads (the suffix is compared in any case); the folder holding it
    was taken for a Hugging Face folder, as its glob was case-sensitive."""
    from argosy_runtime.model_loader import resolve_model_path

    (tmp_path / "Model-Q4_K_M.GGUF").write_bytes(b"GGUF")
    (tmp_path / "notes.gguf").mkdir()  # a folder, not a model file
    assert resolve_model_path(tmp_path) == (tmp_path / "Model-Q4_K_M.GGUF", "gguf")


@pytest.mark.parametrize("buffer", ["inv_freq", "cos_cached", "sin_cached"])
def test_rotary_buffers_in_the_checkpoint_are_skipped(random_llama_dir: Path, tmp_path: Path,
                                                      buffer: str) -> None:
    """Recomputed rotary buffers some checkpoints carry (ColossalAI-trained Llamas: the cos /
    sin caches, which vLLM skips) are not weights: they were refused as unexpected tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "with-buffers"
    shutil.copytree(random_llama_dir, folder)
    state = load_file(folder / "model.safetensors")
    expected = set(state)
    state[f"model.layers.0.self_attn.rotary_emb.{buffer}"] = torch.ones(2048, 16)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert {name for name, _ in load_checkpoint(folder).iter_weights()} == expected
