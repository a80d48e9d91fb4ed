"""How many characters of input one token can cover at most, read from a `tokenizers` backend.

The server uses it to refuse a text that cannot fit the model's context whatever its
tokenization (more counted characters than max_model_len * per_token) without tokenizing it: a
30 MB prompt used to cost a minute of tokenizer time just to learn that it was too long.

The bound must hold for every input, so it exists only where each token stands for a
contiguous run of at most that many (normalized) characters and the pipeline drops none, or
drops only characters we can name and leave uncounted:

- the model is BPE (each token is a vocabulary string; an unknown character is one unk token,
  or bytes with byte_fallback) or Unigram with byte_fallback (and the <0xNN> byte tokens:
  without them byte_fallback falls back to unk). WordPiece and WordLevel map a whole word of
  any length to one token ([UNK] past max_input_chars_per_word), and BPE or Unigram fuse a
  run of unknown characters into one unk: no bound;
- the normalizer and pre-tokenizer drop no characters: Strip, StripAccents, BertNormalizer
  (clean_text), Precompiled, Whitespace, BertPreTokenizer and the like can turn a long text
  into a short one, so any of them (or one not listed) means no bound. NFC/NFKC compose at
  most 4 characters into one (the longest canonical decomposition), so they multiply it by 4;
- no added token has lstrip/rstrip (those swallow any run of whitespace beside them);
- a BPE without unk_token drops a character that is not in its vocabulary: without byte-level
  spelling that is most of Unicode (no bound); with it, the characters whose every UTF-8 byte
  is missing from the vocabulary (SmolLM2 has no token for the bytes 0x04, 0x06, ...: 100k x
  "\x04" is 0 tokens). Those are named (`CharacterBound.dropped`) when they are ASCII; a
  missing continuation byte (0x80-0xBF) would let multi-byte characters vanish: no bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Normalizers -> how many input characters one normalized character may stand for.
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1,
                      "ByteLevel": 1}
_BYTE_TOKENS = frozenset(f"<0x{b:02X}>" for b in range(256))
# Pre-tokenizers that keep every character (ByteLevel and Metaspace only respell them).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                           "Punctuation"}


@dataclass(frozen=True)
class CharacterBound:
    """One token covers at most `per_token` characters of input, not counting the characters
    in `dropped` (which the tokenizer may turn into nothing)."""

    per_token: int
    dropped: frozenset[str] = frozenset()

    def counted(self, text: str) -> int:
        """The characters of `text` that each need a share of some token."""
        return len(text) - sum(text.count(c) for c in self.dropped)


def character_bound(backend: Any) -> CharacterBound | None:
    """The bound of `backend` (a `tokenizers.Tokenizer`), or None where no bound exists
    (see the module doc)."""
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    model = spec.get("model") or {}
    longest = _longest_model_token(model)
    dropped = _dropped_characters(spec)
    if longest is None or dropped is None:
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None
        longest = max(longest, len(added.get("content", "")))
    return CharacterBound(max(longest, 1) * shrink, dropped)


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for inner in normalizer.get("normalizers", []):
            factor = _normalizer_shrink(inner)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":  # a plain string replaced by one at least as long keeps the count
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        return 1 if pattern is not None and len(content) >= len(pattern) else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", []))
    if pre_tokenizer.get("behavior") == "Removed":  # Split, Punctuation: drops what matches
        return False
    return kind in _KEEPING_PRE_TOKENIZERS


def _longest_model_token(model: dict[str, Any]) -> int | None:
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return None
    vocab = model.get("vocab") or []
    pieces = list(vocab) if kind == "BPE" else [piece for piece, _ in vocab]
    # An unknown character becomes bytes (byte_fallback), else the unk token: one per
    # character unless fused (Unigram always fuses), one for a run of any length.
    fuses_unk = kind == "Unigram" or (model.get("unk_token") is not None and model.get("fuse_unk"))
    if fuses_unk and not _falls_back_to_bytes(model, pieces):
        return None
    return max((len(piece) for piece in pieces), default=1)


def _falls_back_to_bytes(model: dict[str, Any], pieces: list[str]) -> bool:
    """Whether an unknown character becomes its byte tokens: byte_fallback does that only when
    the vocabulary has them (<0x00>..<0xFF>), and falls back to the fused unk otherwise."""
    return bool(model.get("byte_fallback")) and _BYTE_TOKENS <= set(pieces)


def _dropped_characters(spec: dict[str, Any]) -> frozenset[str] | None:
    """The input characters the model may drop (empty: none), or None where they cannot be
    named. Only a BPE without unk_token (and without complete byte fallback) drops any."""
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if model.get("type") != "BPE" or model.get("unk_token") is not None or \
            _falls_back_to_bytes(model, list(vocab)):
        return frozenset()
    # Which characters vanish depends on what the normalizer made of them: only the
    # byte-level spelling of the raw text is followed here.
    if not _is_byte_level(spec.get("pre_tokenizer")) or \
            spec.get("normalizer") not in (None, {"type": "ByteLevel"}):
        return None
    missing = [b for b, c in _BYTE_TO_UNICODE.items() if c not in vocab]
    if any(0x80 <= b <= 0xBF for b in missing):  # multi-byte characters could vanish whole
        return None
    return frozenset(chr(b) for b in missing if b < 0x80)


def _is_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character that spells it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_TO_UNICODE = _byte_to_unicode()
