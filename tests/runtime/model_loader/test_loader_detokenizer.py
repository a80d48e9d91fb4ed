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


def _byte_token_ids(tok: Tokenizer) -> list[int]:
    """The 256 single-byte tokens of the byte-level vocabulary (lead and continuation bytes)."""
    from argosy_runtime.tokenizer import _bytes_to_unicode

    ids = [tok.token_to_id(c) for c in _bytes_to_unicode().values()]
    return [i for i in ids if i is not None]


def test_random_sequences_property(tok: Tokenizer) -> None:
    """Property: for random prompts and outputs mixing multi-byte characters split over byte
    tokens, runs of special tokens and ordinary tokens, pushed in random chunks, the deltas
    plus flush() add up to decode(output ids), with special tokens skipped or not."""
    rng = random.Random(1234)
    byte_ids = _byte_token_ids(tok)
    multi_byte = [i for i in byte_ids if tok.decode([i]) == "\ufffd"]
    specials = tok.all_special_ids

    spaces = [tok.token_to_id(t) for t in ("Ġ", "ĠĠ", "Ċ", "ĊĊ", "ĉ")]  # whitespace only

    def random_ids(n: int) -> list[int]:
        pools = [multi_byte, specials, spaces, range(tok.vocab_size), tok.encode("日本語 🎉 é")]
        return [rng.choice(rng.choice(pools)) for _ in range(n)]

    for _ in range(300):
        prompt, ids = random_ids(rng.randint(0, 8)), random_ids(rng.randint(1, 25))
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas, start = [], 0
        while start < len(ids):
            size = rng.randint(1, 4)
            deltas.append(detok.push(ids[start : start + size]))
            start += size
        deltas.append(detok.flush())
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected == detok.text, (prompt, ids, skip)
        # no delta shows a half character as U+FFFD that decode does not
        assert sum(d.count("\ufffd") for d in deltas) == expected.count("\ufffd"), ids


def test_character_started_in_the_prompt(tok: Tokenizer) -> None:
    """The prompt ends with the first byte of "é" and the output starts with its second: the
    output alone decodes that byte to U+FFFD; the stream must not swallow it (it used to be
    merged with the prompt's byte, then cut off as if it were part of the prompt's text)."""
    lead, cont = tok.token_to_id("Ã"), tok.token_to_id("©")  # "é" is C3 A9
    detok = IncrementalDetokenizer(tok, tok.encode("Hello ") + [lead])
    output = [cont, *tok.encode(" x")]
    streamed = "".join(detok.push([i]) for i in output) + detok.flush()
    assert streamed == tok.decode(output) == "\ufffd x"


class _CountingTokenizer:
    """Forwards to a Tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.decoded_ids = tok, 0

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_long_run_of_special_tokens_costs_linear_time(tok: Tokenizer, skip_special_tokens: bool) -> None:
    """Skipped special tokens add no text: the decode window used to keep all of them (it only
    moves on visible text), so each push decoded the whole run again, quadratic in its length."""
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("Hi"), skip_special_tokens)  # type: ignore[arg-type]
    n = 2000
    ids = [tok.eos_token_id] * n + tok.encode(" done")
    streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert counting.decoded_ids < 20 * len(ids)


def test_a_long_run_of_invalid_bytes_costs_linear_time_and_streams(tok: Tokenizer) -> None:
    """Bytes that never form a character (lone continuation bytes, as a model forced by a
    logit_bias writes them) end the text in U+FFFD at every push: the window held them all,
    each push decoding the whole run again (quadratic), and nothing streamed until the end."""
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("Hi"))  # type: ignore[arg-type]
    continuation = tok.token_to_id("©")  # byte A9: a character never starts with it
    n = 2000
    ids = [continuation] * n + tok.encode(" é done 🎉")
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas[:n]).count("\ufffd") >= n - 8  # streamed as it came, not held
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    assert counting.decoded_ids < 40 * len(ids)


def test_long_random_byte_runs_still_add_up_to_decode(tok: Tokenizer) -> None:
    """Property, for outputs long enough to pass the held-token limit: random runs of single
    bytes (lead, continuation and ASCII bytes, mostly invalid UTF-8 together), characters
    split over byte tokens and ordinary tokens, pushed in random chunks, add up to decode()."""
    rng = random.Random(77)
    byte_ids = _byte_token_ids(tok)
    pools = [byte_ids, byte_ids, tok.encode("日本語 🎉 é ok"), range(tok.vocab_size)]
    for _ in range(200):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(10, 60))]
        detok = IncrementalDetokenizer(tok, tok.encode("x"))
        deltas, start = [], 0
        while start < len(ids):
            size = rng.randint(1, 3)
            deltas.append(detok.push(ids[start : start + size]))
            start += size
        assert "".join(deltas) + detok.flush() == tok.decode(ids), ids
