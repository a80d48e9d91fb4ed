"""`argosy perplexity`: window arithmetic, and the CLI's number against transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from argosy_runtime.cli.main import main
from argosy_runtime.cli.perplexity import sliding_windows
from hypothesis import given
from hypothesis import strategies as st
from model_factory import make_random_model_dir


@given(st.integers(2, 3000), st.integers(2, 600), st.data())
def test_every_token_after_the_first_is_scored_once(num_tokens: int, window: int, data) -> None:
    stride = data.draw(st.integers(1, window - 1))
    spans = sliding_windows(num_tokens, window, stride)
    scored = [i for _, end, first in spans for i in range(first, end)]
    assert scored == list(range(1, num_tokens))
    for begin, end, first in spans:
        assert 0 <= begin < first <= end <= num_tokens and end - begin <= window
        # context: the scored tokens see every earlier token of the window
        assert first == 1 or first - begin >= min(window - stride, first)


@pytest.mark.parametrize(("window", "stride"), [(1, 1), (8, 0), (8, 8)])
def test_bad_windows_raise(window: int, stride: int) -> None:
    with pytest.raises(ValueError, match="window|stride"):
        sliding_windows(100, window, stride)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("ppl"), "llama", init_std=0.05)


def test_cli_matches_transformers(tiny_model: Path, tmp_path: Path, capsys) -> None:
    import transformers

    text = ("Perplexity measures how well a language model predicts a text: the exponential "
            "of the average negative log-likelihood of each token given the ones before it.")
    path = tmp_path / "text.txt"
    path.write_text(text)
    assert main(["perplexity", "--model", str(tiny_model), "--dtype", "float32",
                 "--window", "512", str(path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss.item()  # mean NLL over tokens 1..n-1
    assert result["tokens"] == ids.shape[1] - 1
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-3)
    assert result["weight_bytes"] == sum(p.numel() * 4 for p in hf.parameters())
    spec = hf.config
    per_token = 2 * spec.num_hidden_layers * spec.num_key_value_heads * (
        spec.hidden_size // spec.num_attention_heads) * 4
    assert result["kv_bytes_per_token"] == per_token


def test_cli_quantized_weights_are_smaller(tiny_model: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "text.txt"
    path.write_text("A short text to score with int8 and int4 weights. " * 8)
    sizes = {}
    for quant in ("none", "int8", "int4"):
        extra = [] if quant == "none" else ["--quantization", quant, "--quantization-group-size", "32"]
        assert main(["perplexity", "--model", str(tiny_model), "--dtype", "float32", *extra,
                     "--window", "32", "--stride", "16", str(path)]) == 0
        sizes[quant] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    base = sizes["none"]
    for quant in ("int8", "int4"):
        assert sizes[quant]["weight_bytes"] < base["weight_bytes"]
        # a random model at float32: quantization noise moves perplexity only a little
        assert sizes[quant]["perplexity"] == pytest.approx(base["perplexity"], rel=0.05)
    assert sizes["int4"]["weight_bytes"] < sizes["int8"]["weight_bytes"]


def test_a_window_may_fill_the_whole_context(tmp_path: Path, capsys) -> None:
    """Windows of max_model_len tokens (64 here) run whole: each is a prompt-only request,
    so no room is held back for a generated token."""
    import transformers

    model = make_random_model_dir(tmp_path, "llama", init_std=0.05, max_position_embeddings=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    path = tmp_path / "text.txt"
    path.write_text("Every window here is exactly as long as the model's context. " * 12)
    num_tokens = len(tokenizer(path.read_text()).input_ids)
    assert num_tokens > 64
    assert main(["perplexity", "--model", str(model), "--dtype", "float32", "--window", "64",
                 "--stride", "32", str(path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == num_tokens - 1
