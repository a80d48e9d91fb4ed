"""How many characters of input one token can cover at most, read from a `tokenizers` backend.

The server uses it to refuse a text that cannot fit the model's context whatever its
tokenization (len(text) > max_model_len * max_chars_per_token) without tokenizing it: a 30 MB
prompt used to cost a minute of tokenizer time just to learn that it was too long.

The bound must hold for every input, so it exists only where each token stands for a
contiguous run of at most that many (normalized) characters and the pipeline drops none:

- the model is BPE (each token is a vocabulary string; an unknown character is one unk token,
  or bytes with byte_fallback) or Unigram with byte_fallback (and the <0xNN> byte tokens:
  without them byte_fallback falls back to unk). WordPiece and WordLevel map a whole word of
  any length to one token ([UNK] past max_input_chars_per_word), and BPE or Unigram fuse a
  run of unknown characters into one unk: no bound;
- the normalizer and pre-tokenizer drop no characters: Strip, StripAccents, BertNormalizer
  (clean_text), Precompiled, Whitespace, BertPreTokenizer and the like can turn a long text
  into a short one, so any of them (or one not listed) means no bound. NFC/NFKC compose at
  most 4 characters into one (the longest canonical decomposition), so they multiply it by 4;
- no added token has lstrip/rstrip (those swallow any run of whitespace beside them).
"""

from __future__ import annotations

import json
from typing import Any

# Normalizers -> how many input characters one normalized character may stand for.
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1,
                      "ByteLevel": 1}
_BYTE_TOKENS = frozenset(f"<0x{b:02X}>" for b in range(256))
# Pre-tokenizers that keep every character (ByteLevel and Metaspace only respell them).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                           "Punctuation"}


def max_chars_per_token(backend: Any) -> int | None:
    """An upper bound on the input characters one token of `backend` (a
    `tokenizers.Tokenizer`) covers, or None where no bound exists (see the module doc)."""
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    longest = _longest_model_token(spec.get("model") or {})
    if longest is None:
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None
        longest = max(longest, len(added.get("content", "")))
    return max(longest, 1) * shrink


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
