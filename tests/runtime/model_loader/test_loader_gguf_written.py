"""GGUF files converted from random HF folders the way llama.cpp converts them: loading them
must give back exactly the original HF weights (q/k permutation undone for Llama, Qwen2 biases
and tied embeddings kept), and the original config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from model_factory import write_gguf_from_hf_dir
from safetensors.torch import load_file


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        state.update(load_file(str(file)))
    return state


@pytest.fixture(scope="module")
def llama_gguf(random_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_from_hf_dir(random_llama_dir, tmp_path_factory.mktemp("gguf") / "llama.gguf")


@pytest.fixture(scope="module")
def qwen2_gguf(random_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (tied, q/k/v bias) with F16 matrices and Qwen2's pre-tokenizer name."""
    out = tmp_path_factory.mktemp("gguf") / "qwen2.gguf"
    return write_gguf_from_hf_dir(random_qwen2_dir, out, float16=True, pre="qwen2")


@pytest.mark.parametrize(
    ("hf_fixture", "gguf_fixture", "float16"),
    [("random_llama_dir", "llama_gguf", False), ("random_qwen2_dir", "qwen2_gguf", True)],
)
def test_gguf_round_trip_gives_original_weights(
    hf_fixture: str, gguf_fixture: str, float16: bool, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(hf_fixture)
    gguf_file: Path = request.getfixturevalue(gguf_fixture)
    from_gguf = load_checkpoint(str(gguf_file))
    from_hf = load_checkpoint(str(folder))
    assert from_gguf.format == "gguf"

    # GGUF stores rms_norm_eps as float32 (1e-5 -> 9.99999974e-06, as transformers reads it too).
    assert from_gguf.spec.rms_norm_eps == pytest.approx(from_hf.spec.rms_norm_eps, rel=1e-7)
    expected_spec = from_hf.spec.__dict__ | {
        "checkpoint_dtype": "float32",
        "rms_norm_eps": from_gguf.spec.rms_norm_eps,
    }
    # max_position_embeddings, rope, heads, bias, tying: all from metadata and tensor list.
    assert from_gguf.spec.__dict__ == expected_spec

    original = _hf_state(folder)
    weights = dict(from_gguf.iter_weights())
    assert set(weights) == {n for n, _ in from_hf.iter_weights()}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        expected = original[name].float()
        if float16 and expected.ndim == 2:
            expected = expected.half().float()
        assert torch.equal(tensor, expected), name


def test_qwen2_pre_tokenizer_matches_transformers(qwen2_gguf: Path) -> None:
    """tokenizer.ggml.pre = "qwen2" selects Qwen2's split regex, as in transformers."""
    from transformers import AutoTokenizer

    ours = load_checkpoint(str(qwen2_gguf)).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(qwen2_gguf.parent), gguf_file=qwen2_gguf.name)
    for text in ["Numbers 12345 and  100%", "it's   spaced\n\n\nlines", "日本語 text 🎉", "x=1;y=22"]:
        assert ours.encode(text) == theirs.encode(text), text
    # Qwen2's regex splits digits one by one; GPT-2's default keeps "12345" together.
    assert ours.convert_ids_to_tokens(ours.encode("12345")) == ["1", "2", "3", "4", "5"]
