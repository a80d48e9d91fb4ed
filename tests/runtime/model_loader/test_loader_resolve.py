"""resolve_model_path: aliases, folders, .gguf files and clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from argosy_runtime.model_loader import load_checkpoint, resolve_model_path


def test_alias(gguf_path: Path) -> None:
    assert resolve_model_path("smollm2-135m") == (gguf_path, "gguf")
    assert resolve_model_path("SmolLM2-135M") == (gguf_path, "gguf")


def test_gguf_file_and_folder(gguf_path: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(gguf_path)) == (gguf_path, "gguf")
    # A folder with one .gguf and no config.json is that GGUF.
    folder = tmp_path / "ggufdir"
    folder.mkdir()
    os.symlink(gguf_path, folder / "model.gguf")
    assert resolve_model_path(str(folder)) == (folder / "model.gguf", "gguf")


def test_hf_folder(random_llama_dir: Path) -> None:
    assert resolve_model_path(str(random_llama_dir)) == (random_llama_dir, "hf")


def test_missing_path_is_file_not_found() -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        resolve_model_path("no-such-model")
    assert "smollm2-135m" in str(info.value)  # lists the known aliases


def test_non_gguf_file_is_value_error(tmp_path: Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(file))


def test_corrupt_gguf_is_value_error(tmp_path: Path) -> None:
    file = tmp_path / "broken.gguf"
    file.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_checkpoint(str(file))


def test_empty_folder_has_no_weights(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(str(tmp_path))
