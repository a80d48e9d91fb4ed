"""Our tokenizer against transformers': the embedded GGUF's vocabulary and a HF folder."""

from __future__ import annotations

import re

import pytest
from argosy_runtime.model_loader import Checkpoint
from argosy_runtime.tokenizer import Tokenizer
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nmixed \t \n whitespace",
    "Unicode: héllo wörld, naïve café, Ελληνικά, русский, العربية, עברית",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "Combining: e\u0301 a\u0308 and zero-width\u200bjoiner",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e-9 0xFF 1,000,000",
    "Dates 2024-01-01T12:00:00Z and prices $5.99 €10 ¥1000",
    "Contractions: I'm, you're, it's, we'll, they'd, can't, won't",
    "UPPER lower MiXeD CamelCaseIdentifiers snake_case_names kebab-case",
    "Special tokens <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text right after a special token<|im_end|>",
    "Fake special <|not_a_token|> and <im_start> stay text",
    "Repeated!!!!!!!!???? ........ ------ ======",
    "URL https://example.com/path?query=1&x=y#frag and email a.b@c.de",
    "Math: ∑_{i=1}^{n} x_i² ≤ ∞, √2 ≈ 1.414, α β γ",
    "\u00a0non-breaking\u00a0spaces\u2003em-space\u3000ideographic",
]

# Byte-level BPE vocabularies of the StarCoder/SmolLM family split every digit apart before
# GPT-2's regex (llama.cpp `tokenizer.ggml.pre` = "smollm"; SmolLM2's tokenizer.json has
# Digits(individual_digits=True)). transformers' GGUF loader does not, which only matters for
# a run of 2+ whitespace characters before a digit.
WHITESPACE_BEFORE_DIGIT = re.compile(r"\s\s\d")
DIVERGENT_TEXTS = ["  100%", "x =  1", "a\n\n2", "\t\t3 tabs", "  1  2  3"]


def _llamacpp_reference(hf_tokenizer) -> BackendTokenizer:
    """transformers' backend with llama.cpp's pre-tokenization for `smollm` (digits split first)."""
    backend = BackendTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


@pytest.fixture(scope="module")
def tok(gguf_checkpoint: Checkpoint) -> Tokenizer:
    return gguf_checkpoint.tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok: Tokenizer, hf_gguf_tokenizer, add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert not WHITESPACE_BEFORE_DIGIT.search(text)
        expected = hf_gguf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_digits_follow_llamacpp_pre_tokenizer(tok: Tokenizer, hf_gguf_tokenizer) -> None:
    reference = _llamacpp_reference(hf_gguf_tokenizer)
    for text in TEXTS + DIVERGENT_TEXTS:
        assert tok.encode(text) == reference.encode(text).ids, text
    # Where the two pre-tokenizations differ, we follow llama.cpp: "  1" -> "ĠĠ", "1".
    assert tok.convert_ids_to_tokens(tok.encode("  100%")) == ["ĠĠ", "1", "0", "0", "%"]
    assert hf_gguf_tokenizer.encode("  100%") != tok.encode("  100%")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_gguf_tokenizer, skip_special_tokens: bool) -> None:
    for text in TEXTS + DIVERGENT_TEXTS:
        ids = tok.encode(text)
        expected = hf_gguf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text
        if not skip_special_tokens:
            assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips
    # Arbitrary id sequences, including special and partial-UTF-8 tokens.
    ids = [1, 5, 6004, 2, 0, 16, 12345, 140, 33, 48000]
    assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == hf_gguf_tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens
    )


def test_special_tokens(tok: Tokenizer, hf_gguf_tokenizer) -> None:
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert tok.bos_token_id == hf_gguf_tokenizer.bos_token_id == 1
    assert tok.eos_token_ids == (hf_gguf_tokenizer.eos_token_id,) == (2,)
    assert tok.pad_token_id == hf_gguf_tokenizer.pad_token_id
    # Every token transformers treats as special (decode skips it) is in all_special_ids.
    hf_special = {i for i, t in hf_gguf_tokenizer.added_tokens_decoder.items() if t.special}
    assert set(tok.all_special_ids) == hf_special | set(hf_gguf_tokenizer.all_special_ids)
    assert tok.convert_ids_to_tokens([1, 2, 504]) == hf_gguf_tokenizer.convert_ids_to_tokens([1, 2, 504])
    # SmolLM2's GGUF says add_bos_token = false: no BOS even with special tokens on.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 🎨?"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_gguf_tokenizer, messages, add_generation_prompt: bool
) -> None:
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


# A Llama-3-style template exercising bos_token, tojson, raise_exception, namespace, loop
# controls and whitespace control, rendered by both implementations.
CUSTOM_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('bad role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<|start|>{{ message['role'] }} #{{ ns.n }}
{{ message['content'] | trim }}{{ message | tojson }}<|end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|start|>assistant
{% endif %}"""


def test_custom_template_features_match_transformers(tok: Tokenizer, hf_gguf_tokenizer) -> None:
    custom = Tokenizer(tok.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CUSTOM_TEMPLATE)
    messages = CONVERSATIONS[2] + [{"role": "system", "content": "skipped \"quoted\" <b>é</b>"}]
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, chat_template=CUSTOM_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert custom.apply_chat_template(messages) == expected
    assert '"content": "Another, in 日本語 🎨?"' in expected  # tojson: no ASCII/HTML escaping
    with pytest.raises(ValueError, match="bad role tool"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_folder_tokenizer_matches_transformers(random_llama_dir) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_folder(random_llama_dir)
    theirs = AutoTokenizer.from_pretrained(str(random_llama_dir))
    for text in TEXTS + DIVERGENT_TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_hf_folder_without_tokenizer_json(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_character_bound_holds_for_every_text(tok: Tokenizer) -> None:
    # SmolLM2's byte-level BPE: no token covers more than its longest vocabulary string
    bound = tok.character_bound
    assert bound.per_token == 81
    for text in TEXTS:
        assert bound.counted(text) <= max(1, len(tok.encode(text, add_special_tokens=False))) \
            * bound.per_token


def test_characters_with_no_token_are_not_counted(tok: Tokenizer) -> None:
    """SmolLM2's vocabulary has no token for some bytes (0x04, 0x06, ...): a run of them encodes
    to nothing, so counting them made 100k x "\x04" (0 tokens) too long for the model."""
    bound = tok.character_bound
    control = "".join(chr(b) for b in range(0x20))
    vanishing = {c for c in control if not tok.encode(c, add_special_tokens=False)}
    assert vanishing and vanishing == set(bound.dropped)
    for c in control:  # the others each need a token of their own
        assert (c in bound.dropped) == (tok.encode(c * 1000, add_special_tokens=False) == [])
    text = "\x04" * 100_000 + "hi" + "\x06" * 1000
    assert bound.counted(text) == 2
    assert len(tok.encode(text, add_special_tokens=False)) == 1


def test_no_character_bound_where_a_token_covers_any_length() -> None:
    from argosy_runtime.tokenizer_bounds import character_bound
    from tokenizers import models, normalizers

    # WordPiece: a word longer than max_input_chars_per_word is one [UNK], whatever its length
    wordpiece = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(wordpiece.encode("a" * 10_000).ids) == 1
    assert character_bound(wordpiece) is None
    bpe = BackendTokenizer(models.BPE({"<unk>": 0, "a": 1, "b": 2, "ab": 3}, [("a", "b")],
                                      unk_token="<unk>"))
    assert character_bound(bpe).per_token == 5  # "<unk>" for any one unknown character
    bpe.normalizer = normalizers.Strip()  # "   ...   " strips to nothing
    assert character_bound(bpe) is None
    bpe.normalizer = normalizers.NFC()  # composes at most 4 characters into one
    assert character_bound(bpe).per_token == 20
    # without unk_token a BPE drops every character outside its vocabulary
    bare = BackendTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    assert bare.encode("c" * 10_000).ids == []
    assert character_bound(bare) is None


def test_byte_level_bpe_missing_a_continuation_byte_has_no_character_bound() -> None:
    """Without the token for a continuation byte (0x80-0xBF) whole multi-byte characters can
    vanish: "\u0100" is C4 80 and "\u00c4" C3 84; dropping 80, 84, C3 and C4 drops both."""
    from argosy_runtime.tokenizer_bounds import _BYTE_TO_UNICODE, character_bound
    from tokenizers import models

    def byte_level(missing: set[int]) -> BackendTokenizer:
        vocab = {c: i for i, (b, c) in enumerate(_BYTE_TO_UNICODE.items()) if b not in missing}
        backend = BackendTokenizer(models.BPE(vocab, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        return backend

    backend = byte_level({0x80, 0x84, 0xC3, 0xC4})
    assert backend.encode("\u0100\u00c4" * 1000).ids == []
    assert character_bound(backend) is None
    # a missing lead byte alone leaves each character's continuation bytes: still bounded
    backend = byte_level({0xC3, 0x04})
    assert len(backend.encode("\u00c4" * 1000).ids) == 1000
    bound = character_bound(backend)
    assert bound is not None and bound.dropped == frozenset("\x04")


@pytest.mark.parametrize("kind", ["BPE", "Unigram"])
def test_byte_fallback_without_byte_tokens_has_no_character_bound(kind: str) -> None:
    """byte_fallback spells an unknown character as <0xNN> tokens only when those tokens are in
    the vocabulary; without them it falls back to unk, which fuses a run of unknown characters
    into one token: no bound (a 10,000-character text of one token was refused as too long)."""
    from argosy_runtime.tokenizer_bounds import character_bound
    from tokenizers import models

    if kind == "BPE":
        model = models.BPE({"<unk>": 0, "a": 1, "b": 2, "ab": 3}, [("a", "b")],
                           unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    else:
        model = models.Unigram([("<unk>", 0.0), ("a", -1.0), ("ab", -2.0)], unk_id=0,
                               byte_fallback=True)
    backend = BackendTokenizer(model)
    bound = character_bound(backend)
    text = "é" * 10_000
    assert len(backend.encode(text).ids) == 1
    assert bound is None or len(text) <= bound.per_token
    # with every byte token in the vocabulary the bound holds: each byte is a token
    vocab_bytes = [f"<0x{b:02X}>" for b in range(256)]
    if kind == "BPE":
        vocab = {t: i for i, t in enumerate(["<unk>", "a", "b", "ab", *vocab_bytes])}
        model = models.BPE(vocab, [("a", "b")], unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    else:
        model = models.Unigram([("<unk>", 0.0), ("a", -1.0), ("ab", -2.0)]
                               + [(t, -9.0) for t in vocab_bytes], unk_id=0, byte_fallback=True)
    backend = BackendTokenizer(model)
    assert character_bound(backend).per_token == 6  # "<0xC3>"
    assert len(backend.encode(text).ids) == 2 * len(text)


# Features of Hub templates that transformers' environment supports: `tools`/`documents` are
# none (not undefined) when not given, and `{% generation %}` marks the assistant's text.
TOOLS_TEMPLATE = """{%- if tools is not none %}<tools>{{ tools | tojson }}</tools>
{% endif %}
{%- if documents is not none %}<docs>{{ documents | length }}</docs>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
{%- else %}{{ message.role }}: {{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}assistant:{% endif %}"""


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]])
def test_template_tools_and_generation_tags_match_transformers(tok: Tokenizer, hf_gguf_tokenizer,
                                                                tools) -> None:
    custom = Tokenizer(tok.backend, eos_token="<|im_end|>", chat_template=TOOLS_TEMPLATE)
    messages = CONVERSATIONS[2]
    extra = {"tools": tools} if tools else {}
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True, **extra
    )
    assert custom.apply_chat_template(messages, **extra) == expected
    assert ("<tools>" in expected) == bool(tools) and "<docs>" not in expected
