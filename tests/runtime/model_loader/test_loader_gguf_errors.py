"""Clear errors for GGUF files we cannot serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from argosy_runtime.model_loader import load_checkpoint
from gguf import GGUFWriter


def _write(path: Path, arch: str, tokenizer_model: str = "gpt2") -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'gemma2'.*supported: llama, qwen2.*phi3, gemma3"):
        load_checkpoint(str(_write(tmp_path / "gemma2.gguf", "gemma2")))


def test_unsupported_gguf_tokenizer_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model 't5'"):
        load_checkpoint(str(_write(tmp_path / "t5.gguf", "llama", tokenizer_model="t5")))


def test_minimal_gguf_loads(tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(_write(tmp_path / "tiny.gguf", "llama")))
    assert ckpt.spec.vocab_size == 3 and ckpt.spec.head_dim == 4 and ckpt.spec.tie_word_embeddings
    assert ckpt.tokenizer.encode("ab") == [2]
    assert ckpt.tokenizer.bos_token_id is None and ckpt.spec.eos_token_ids == ()
