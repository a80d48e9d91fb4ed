"""Sentencepiece vocabularies in GGUF (tokenizer.ggml.model = "llama": Llama 2, Mistral).

No such model is available offline, so we train a small sentencepiece-style BPE here, write it
to a GGUF the way llama.cpp stores one (tokens, scores = -rank, token types, byte tokens), and
compare our tokenizer with transformers' tokenizer for the same file."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from argosy_runtime.model_loader.gguf_metadata import open_gguf
from argosy_runtime.tokenizer import Tokenizer
from gguf import GGUFWriter
from tokenizers import SentencePieceBPETokenizer

TEXTS = [
    "Hello world",
    "hello  the world, the end.",
    " leading space and trailing space ",
    "new\nlines\n\nand\ttabs",
    "unseen characters: héllo 日本 🎉 fall back to bytes",
    "<s>special tokens</s> inside text",
    "",
]


def _corpus() -> list[str]:
    # Any English-ish text works; the standard library's docstrings are always at hand.
    import collections
    import json
    import pathlib

    return [inspect.getdoc(m) or "" for m in (collections, json, pathlib, inspect)] * 3


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(_corpus(), vocab_size=800, min_frequency=2, show_progress=False)
    pieces = sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_spm_matches_transformers(spm_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(open_gguf(spm_gguf))
    theirs = AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
    for text in TEXTS + _corpus()[:2]:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == (2,)


def test_spm_behaviour(spm_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(open_gguf(spm_gguf))
    ids = tok.encode("héllo 🎉")
    assert ids[0] == 1  # BOS by default for sentencepiece vocabularies
    assert tok.decode(ids) == "héllo 🎉"  # byte fallback round-trips unseen characters
    assert "<0xF0>" in tok.convert_ids_to_tokens(ids)
    pieces = tok.convert_ids_to_tokens(tok.encode("the world", add_special_tokens=False))
    assert pieces[0].startswith("\u2581")  # a space is prepended and spelled "▁"


def test_spm_streaming_continues_the_prompt(spm_gguf: Path) -> None:
    """With a sentencepiece decoder the first output token's "▁" is a real space after the
    prompt (decode() of the output alone strips it): the stream is the text the output adds."""
    from argosy_runtime.detokenizer import IncrementalDetokenizer

    tok = Tokenizer.from_gguf(open_gguf(spm_gguf))
    prompt = tok.encode("Say")
    output = tok.encode("hello world 🎉 done", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.push([i]) for i in output) + detok.flush()
    assert streamed == tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert streamed == " " + tok.decode(output)
    # Without a prompt the stream equals decode() of the output.
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push([i]) for i in output) + detok.flush() == tok.decode(output)
