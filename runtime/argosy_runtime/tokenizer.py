"""`Tokenizer`: text <-> token ids and chat templates, on top of the `tokenizers` library.

Two sources: a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`) and a GGUF file,
whose metadata holds the vocabulary, merges and special token ids under llama.cpp's key names
(no `tokenizer.json`), from which we rebuild the equivalent `tokenizers.Tokenizer`.

The runtime deliberately does not import transformers; chat templates are rendered with jinja2
the way transformers' `apply_chat_template` does (sandboxed, trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from argosy_runtime.tokenizer_bounds import CharacterBound, character_bound

if TYPE_CHECKING:  # pragma: no cover
    import jinja2
    from gguf import GGUFReader

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes by llama.cpp `tokenizer.ggml.pre` name. Names not listed use
# GPT-2's regex (ByteLevel's built-in one).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp splits every digit apart ("\p{N}") before GPT-2's regex for these vocabularies, as
# their original tokenizer.json does (Digits(individual_digits=True) + ByteLevel). transformers'
# GGUF loader misses this, so it differs from the original on whitespace before a digit
# ("  1" is "ĠĠ","1" here and in llama.cpp, but "Ġ","Ġ1"-style splits in transformers).
_GGUF_DIGIT_SPLIT_PRES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)


def _encode_releasing_gil(backend: BackendTokenizer, text: str | tuple[str, str],
                          add_special_tokens: bool) -> Any:
    """`backend.encode(text)` through the batch entry point: `encode` holds the GIL for the
    whole call (a 10 MB text stopped every other thread of the server for ~25 s), the batch
    methods release it, so a big prompt tokenized in a worker thread leaves the event loop
    free. `encode_batch_fast` (tokenizers >= 0.21) also skips the character offsets, which
    we never read: 2.5x faster on long texts; same ids and type ids."""
    encode_batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    return encode_batch([text], add_special_tokens=add_special_tokens)[0]


# Truncating copies of a backend kept at once (`Tokenizer._truncating`).
TRUNCATING_COPIES = 8


class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens and the chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        tool_use_chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        # A model's template named "tool_use" (Hermes 2 Pro / Hermes 3, Command R): what
        # transformers' get_chat_template (and so vLLM) renders a request with tools through.
        # Set after chat_template: assigning chat_template clears it.
        self._tool_use_chat_template = tool_use_chat_template
        eos_ids = [self._token_id(eos_token)] if eos_token is not None else []
        eos_ids += list(extra_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        # `_truncating`'s copies, most recently used last, and the lock of the server's
        # tokenizing threads over them
        self._truncating_backends: OrderedDict[int, BackendTokenizer] = OrderedDict()
        self._truncating_lock = threading.Lock()

    @property
    def chat_template(self) -> str | None:
        """The model's default chat template (None: it has none)."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, value: str | None) -> None:
        # A template set in its place (--chat-template) is used for every request, tools or
        # not, as vLLM's --chat-template is: the model's own tool_use template goes with it.
        self._chat_template = value
        self._tool_use_chat_template = None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, chat template files) from a folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {folder}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        # Some tokenizer.json files were saved padding and truncating to a fixed length
        # (sentence-transformers/all-MiniLM-L6-v2: 128); transformers' tokenizer(text) does
        # neither unless asked, so neither do we.
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")

        def special(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            return value

        templates = _hf_chat_templates(folder, config)
        return cls(
            backend,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            chat_template=templates.get("default"),
            tool_use_chat_template=templates.get("tool_use"),
        )

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (byte-level BPE, `tokenizer.ggml.model=gpt2`)."""
        from argosy_runtime.model_loader.gguf_metadata import read_field

        model_type = read_field(reader, "tokenizer.ggml.model", None)
        tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens")
        token_types: list[int] = read_field(reader, "tokenizer.ggml.token_type", [])
        if model_type == "gpt2":
            merges: list[str] = read_field(reader, "tokenizer.ggml.merges")
            pre = read_field(reader, "tokenizer.ggml.pre", None)
            backend = _byte_level_bpe(tokens, token_types, merges, pre)
            # llama.cpp's default for BPE vocabularies is no BOS unless the file says otherwise.
            add_bos_default = False
        elif model_type == "llama":
            scores: list[float] = read_field(reader, "tokenizer.ggml.scores")
            add_space_prefix = bool(read_field(reader, "tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_bpe(tokens, scores, token_types, add_space_prefix)
            add_bos_default = True  # sentencepiece Llama/Mistral vocabularies start with <s>
        else:
            raise ValueError(
                f"GGUF tokenizer.ggml.model {model_type!r} is not supported; supported: 'gpt2' "
                "(byte-level BPE: Llama 3, Qwen2, SmolLM), 'llama' (sentencepiece: Llama 2, Mistral)"
            )

        def token_of(key: str) -> str | None:
            token_id = read_field(reader, f"tokenizer.ggml.{key}", None)
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
        add_bos = bool(read_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(read_field(reader, "tokenizer.ggml.add_eos_token", False))
        _set_bos_eos_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
        # End-of-turn / end-of-message tokens also end generation (Llama 3 instruct: <|eot_id|>).
        extra_eos = [
            read_field(reader, f"tokenizer.ggml.{key}", None) for key in ("eot_token_id", "eom_token_id")
        ]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=token_of("padding_token_id"),
            unk_token=token_of("unknown_token_id"),
            chat_template=read_field(reader, "tokenizer.chat_template", None),
            extra_eos_token_ids=[i for i in extra_eos if i is not None],
        )

    # ---- ids and text ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS as the model's tokenizer does.
        `max_length`: at most that many ids, cut from the end as transformers'
        `tokenizer(text, truncation=True, max_length=k)` cuts them (the special tokens stay,
        so a k smaller than they are leaves the text whole, as there)."""
        backend = self.backend if max_length is None else self._truncating(max_length)
        return _encode_releasing_gil(backend, text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, text_pair: str, max_length: int | None = None
                    ) -> tuple[list[int], list[int]]:
        """(token ids, token type ids) of a text pair as the tokenizer's pair template joins
        them (transformers' `tokenizer(text, text_pair)`: what vLLM feeds a cross-encoder;
        BERT's types are 1 on the second text and its [SEP]). Decoder vocabularies mostly have
        no separator, so that is usually the two encodings back to back.
        `max_length`: at most that many ids, as `tokenizer(text, text_pair, truncation=True,
        max_length=k)` cuts them (vLLM's truncate_prompt_tokens for a cross-encoder): tokens
        come off the end of the longer text first, and the special tokens stay (a k smaller
        than they are leaves the pair whole, as there)."""
        backend = self.backend if max_length is None else self._truncating(max_length)
        enc = _encode_releasing_gil(backend, (text, text_pair), add_special_tokens=True)
        return enc.ids, enc.type_ids

    def _truncating(self, max_length: int) -> BackendTokenizer:
        """A copy of the backend that truncates to `max_length` (longest text first, from the
        right: transformers' defaults). A copy, not the shared backend switched on and off: the
        server tokenizes on several threads. Only the last few lengths asked for are kept:
        each copy is a whole vocabulary (8 MB for 49k tokens), and a client may ask for any
        length up to the model's (200 lengths held 1.7 GB)."""
        with self._truncating_lock:
            cache = self._truncating_backends
            backend = cache.pop(max_length, None)
            if backend is None:
                backend = copy.deepcopy(self.backend)
                backend.no_padding()
                backend.enable_truncation(max_length, strategy="longest_first",
                                          direction="right")
            cache[max_length] = backend
            while len(cache) > TRUNCATING_COPIES:
                cache.popitem(last=False)
        return backend

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (BOS, EOS, chat markers) are dropped when asked."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary strings of `ids` (byte-level spelling for BPE vocabularies)."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary string `token`, or None."""
        return self.backend.token_to_id(token)

    @property
    def character_bound(self) -> CharacterBound | None:
        """The most input characters one token can cover (None: no such bound, e.g.
        WordPiece's one [UNK] for a word of any length): a text that needs more than
        max_model_len tokens by this bound cannot fit the model whatever its tokenization."""
        if "_character_bound" not in self.__dict__:
            self._character_bound = character_bound(self.backend)
        return self._character_bound

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (the tokenizer's eos_token)."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (eos_token first, then model/generation config ones)."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens: BOS/EOS/PAD/UNK and every added token marked special."""
        ids = {i for i in (self.bos_token_id, self.pad_token_id, self._token_id(self.unk_token)) if i is not None}
        ids.update(self._eos_token_ids)
        ids.update(self.skipped_special_ids)
        return sorted(ids)

    @property
    def skipped_special_ids(self) -> frozenset[int]:
        """The ids decode(skip_special_tokens=True) drops: the added tokens marked special."""
        if "_skipped_special_ids" not in self.__dict__:
            self._skipped_special_ids = frozenset(
                i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)
        return self._skipped_special_ids

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Also stop on `ids` (e.g. from config.json / generation_config.json)."""
        self._eos_token_ids = tuple(dict.fromkeys([*self._eos_token_ids, *ids]))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ---- chat ----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.

        Same environment as transformers: sandboxed jinja2 with trim_blocks/lstrip_blocks, the
        `raise_exception`, `strftime_now` globals and a non-escaping `tojson` filter; the
        special tokens are available as `bos_token`, `eos_token`, `pad_token`, `unk_token`.
        With `tools`, a model's template named "tool_use" renders instead of its default one,
        as transformers' `get_chat_template(tools=...)` picks it.
        """
        source = self.chat_template
        if template_kwargs.get("tools") is not None and self._tool_use_chat_template:
            source = self._tool_use_chat_template
        if not source:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain completion prompt instead"
            )
        return self.render_template(source, messages, add_generation_prompt, **template_kwargs)

    def render_template(
        self,
        source: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        /,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the jinja template `source` (a template given instead of
        the tokenizer's, such as a score template), in `apply_chat_template`'s environment.
        ValueError when the template refuses them (or fails on them)."""
        variables: dict[str, Any] = {
            # None when not given, as transformers passes them: `{% if tools is not none %}`
            # is true of an undefined variable.
            "tools": None,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        variables.update(template_kwargs)
        import jinja2

        try:
            return compile_chat_template(source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            # `raise_exception(...)` is how a template refuses a conversation it cannot render
            # (roles that do not alternate, a system message): the caller's input, a ValueError.
            raise ValueError(str(exc)) from exc
        except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
            # A template that renders the model's own conversations fails on what this caller
            # sent (a template variable of the wrong type: `messages[-keep_last:]` with a
            # string): the caller's input too, not a server error.
            raise ValueError(f"the chat template failed on this input: "
                             f"{type(exc).__name__}: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _hf_chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The chat templates by name ("default", "tool_use", ...), where transformers finds
    them: template files (chat_template.jinja is "default", additional_chat_templates/X.jinja
    is "X": how transformers saves several), else chat_template.json, else tokenizer_config
    (one template, or a list of named ones)."""
    named: dict[str, str] = {}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        named["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            named[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if named:  # template files take precedence over templates in the configs, as there
        return named
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        return {t.get("name"): t.get("template") for t in template if t.get("template")}
    return {"default": template} if template is not None else {}


def _byte_level_bpe(
    tokens: list[str], token_types: list[int], merges: list[str], pre: str | None
) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp's vocabulary and merges."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are stored in the byte-level alphabet ("Ġthe"); a few files store added tokens
    # as raw text, so respell those the way the BPE model will look them up.
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    split = _GGUF_PRE_TOKENIZER_SPLITS.get(pre or "")
    if pre in _GGUF_DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, token_types, vocab, alphabet)
    return backend


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], token_types: list[int], add_space_prefix: bool
) -> BackendTokenizer:
    """A sentencepiece-style BPE (byte fallback, "▁" for spaces) from llama.cpp's vocabulary.

    The file has token scores but no merges: a merge (a, b) exists when a, b and a+b are all
    tokens, ranked by the score of a+b (sentencepiece merges the best-scoring pair first).
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    candidates: list[tuple[float, str, str]] = []
    for merged, score in zip(tokens, scores, strict=False):
        local = [
            (score, merged[:cut], merged[cut:])
            for cut in range(1, len(merged))
            if merged[:cut] in vocab and merged[cut:] in vocab
        ]
        local.sort(key=lambda c: (vocab[c[1]], vocab[c[2]]))
        candidates.extend(local)
    # The order transformers' generate_merges uses: score, then longer left and right pieces
    # first; ties keep the order above (merged token id, then piece ids) as the sort is stable.
    candidates.sort(key=lambda c: (-c[0], -len(c[1]), -len(c[2])))
    merges = [(left, right) for _, left, right in candidates]
    unk = next((t for t, k in zip(tokens, token_types, strict=False) if k == _TOKEN_TYPE_UNKNOWN), None)
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_added_tokens(backend, tokens, token_types, vocab, None)
    return backend


def _add_gguf_added_tokens(
    backend: BackendTokenizer,
    tokens: list[str],
    token_types: list[int],
    vocab: dict[str, int],
    alphabet: set[str] | None,
) -> None:
    """Register control tokens as special and user-defined tokens as added (matched whole).

    Control tokens (<|im_start|>, <|eot_id|>, <s>) are "special": decode(skip_special_tokens)
    drops them. User-defined ones are matched whole but kept. In a byte-level vocabulary a
    control token spelled outside the byte alphabet is a llama.cpp mislabel and is skipped.
    """
    types = token_types or [0] * len(tokens)
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)


def _set_bos_eos_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """Make encode(add_special_tokens=True) prepend BOS / append EOS when the model wants them."""
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's --chat-template takes it: the path of a file holding
    it, or the template itself on one line (escapes such as \\n are decoded). ValueError
    for a value that looks like a path but names no readable file, or for a template jinja
    cannot compile."""
    import codecs

    import jinja2

    try:
        with open(value, encoding="utf-8") as f:
            source = f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"chat template {value!r} looks like a file path, but it cannot "
                             f"be read: {exc}") from exc
        source = codecs.decode(value, "unicode_escape")
    try:
        compile_chat_template(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template {value!r} is not a valid jinja template: {exc}") from exc
    return source


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}`, transformers' mark of the assistant's text
        (for its training masks): rendered as its body. Without it such templates fail to
        compile."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[Any]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None,
        separators: Any = None, sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes; transformers' (and the templates') expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
