"""Clear errors for GGUF files we cannot serve."""

from __future__ import annotations

from pathlib import Path

import pytest
from argosy_runtime.model_loader import load_checkpoint
from model_factory import write_tiny_gguf


def _write(path: Path, arch: str, tokenizer_model: str = "gpt2") -> Path:
    return write_tiny_gguf(path, arch, tokenizer_model=tokenizer_model)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'gemma'.*supported: llama, qwen2.*phi3, gemma2, gemma3"):
        load_checkpoint(str(_write(tmp_path / "gemma.gguf", "gemma")))


def test_unsupported_gguf_tokenizer_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model 't5'"):
        load_checkpoint(str(_write(tmp_path / "t5.gguf", "llama", tokenizer_model="t5")))


def test_minimal_gguf_loads(tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(_write(tmp_path / "tiny.gguf", "llama")))
    assert ckpt.spec.vocab_size == 3 and ckpt.spec.head_dim == 4 and ckpt.spec.tie_word_embeddings
    assert ckpt.tokenizer.encode("ab") == [2]
    assert ckpt.tokenizer.bos_token_id is None and ckpt.spec.eos_token_ids == ()
