"""IncrementalDetokenizer: streamed deltas add up to decode(), never half a character."""

from __future__ import annotations

import random

import pytest
from argosy_runtime.detokenizer import IncrementalDetokenizer
from argosy_runtime.model_loader import Checkpoint
from argosy_runtime.tokenizer import Tokenizer

STREAM_TEXTS = [
    "Plain ASCII text, with punctuation; and numbers 12345.",
    "Multi-byte: héllo wörld — naïve café… 日本語のテキスト 한국어",
    "Emoji split over byte tokens: 🎉🚀👩‍👩‍👧‍👦🇫🇷 done",
    "Code:\n\tdef f(x):\n\t\treturn {'a': x ** 2}\n",
    "<|im_start|>assistant\nSpecial tokens inside<|im_end|> and after",
]


@pytest.fixture(scope="module")
def tok(gguf_checkpoint: Checkpoint) -> Tokenizer:
    return gguf_checkpoint.tokenizer


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == ids
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_one_token_at_a_time(tok: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    prompt = tok.encode("User said: ")
    ids = tok.encode(text)
    deltas = _stream(tok, prompt, ids, [1] * len(ids), skip_special_tokens)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    # No delta ever shows a replacement character for a character still being assembled.
    assert all("\ufffd" not in d for d in deltas)
    if "🎉" in text:
        # Multi-byte characters really were spread over several tokens (some pushes gave "").
        assert "" in deltas


def test_random_chunks_and_prompts(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        for _ in range(5):
            chunks, left = [], len(ids)
            while left:
                size = min(left, rng.randint(1, 4))
                chunks.append(size)
                left -= size
            prompt = tok.encode(rng.choice(["", "Hi", "日本", "a\n"]))
            deltas = _stream(tok, prompt, ids, chunks, skip=True)
            assert "".join(deltas) == tok.decode(ids)


def test_random_token_ids_match_decode(tok: Tokenizer) -> None:
    """Arbitrary ids (as a random model emits them) still add up to decode() after flush."""
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, [rng.randrange(tok.vocab_size) for _ in range(3)])
        text = "".join(detok.push([i]) for i in ids) + detok.flush()
        assert text == tok.decode(ids) == detok.text


def test_incomplete_character_is_held_then_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    # The emoji's 4 UTF-8 bytes are more than one token: the last token completes it.
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push([i]) for i in ids[:-1]) == "ok"
    assert detok.flush() == tok.decode(ids[:-1])[len("ok") :]  # "\ufffd"-style remainder
    assert detok.flush() == ""
    assert detok.push([]) == ""
