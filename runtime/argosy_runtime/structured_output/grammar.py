"""Compiling `StructuredOutputsParams` with llguidance, and one matcher per sequence.

llguidance (the Rust library vLLM and SGLang also use) parses incrementally with an Earley
parser over a lexer, so a grammar compiles in about a millisecond and a step's token mask over
a 49k-token vocabulary takes 0.02-1.5 ms (0.25 ms on average for JSON): there is no
per-schema automaton to precompute.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from argosy_runtime.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from argosy_runtime.tokenizer import Tokenizer

logger = logging.getLogger("argosy.structured_output")


class GrammarCompiler:
    """Turns params into matchers for one model's tokenizer. Compiled grammars are cached by
    their spec (an LRU of `cache_size`), so repeated schemas cost one deep copy.

    Thread-safe: the server compiles (`check`) in a worker thread before admitting a request,
    so a slow grammar never stalls the engine thread, which then finds it in the cache.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = 64) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one sequence. Raises ValueError for an invalid spec."""
        return RequestGrammar(self._prototype(params).deep_copy(), self._vocab_size)

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError if the spec cannot compile; otherwise cache it."""
        self._prototype(params)

    def _prototype(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        import llguidance

        key = params.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            if self._ll_tokenizer is None:  # about 0.2 s for a 49k vocabulary, once
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                    eos_token=self._eos_token_ids or None)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, _llguidance_grammar(params),
                                       log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_one_line(matcher.get_error())}")
        matcher.compute_bitmask()  # a grammar that matches nothing fails only here
        if matcher.is_error():
            raise ValueError("structured_outputs: no output can match this grammar "
                             f"({_one_line(matcher.get_error())})")
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher


class RequestGrammar:
    """One sequence's parser state. It follows the sequence's output tokens lazily: every call
    first brings the matcher to the given output (consuming new tokens, rolling back ones a
    speculative verification tried), so callers never track what it has seen."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._consumed: list[int] = []
        self._warned = False

    def sync(self, output_token_ids: Sequence[int]) -> None:
        consumed = self._consumed
        common = min(len(consumed), len(output_token_ids))
        if consumed[:common] != list(output_token_ids[:common]):
            common = next(i for i in range(common) if consumed[i] != output_token_ids[i])
        if common < len(consumed):
            self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
        if len(output_token_ids) > common:
            new = list(output_token_ids[common:])
            if not self._matcher.consume_tokens(new) and not self._warned:
                self._warned = True  # only an unmasked token gets here; the request then stops
                logger.warning("structured output left its grammar: %s",
                               _one_line(self._matcher.get_error()))
            consumed.extend(new)

    def allowed_tokens(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (only EOS once it is done)."""
        self.sync(output_token_ids)
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[: self._vocab_size].bool()

    def is_done(self, output_token_ids: Sequence[int]) -> bool:
        """True once nothing but EOS may follow (or the matcher failed): the request ends."""
        self.sync(output_token_ids)
        return self._matcher.is_stopped()

    def forced_tokens(self, output_token_ids: Sequence[int]) -> list[int]:
        """Tokens the grammar forces next, in their canonical tokenization (llguidance stops
        before a token that could merge with what follows, so forcing never splits a word
        in a way the model was not trained on)."""
        self.sync(output_token_ids)
        return self._matcher.compute_ff_tokens()

    def valid_prefix(self, output_token_ids: Sequence[int], tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar would accept after the output."""
        self.sync(output_token_ids)
        return tokens[: self._matcher.validate_tokens(tokens)] if tokens else tokens


def _llguidance_grammar(params: StructuredOutputsParams) -> str:
    import llguidance

    options = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=options)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's messages span lines (a caret under the error, a parser state dump after
    it); an API error is one line."""
    text = " ".join(message.split("<state>")[0].split()) or "invalid grammar"
    return text if len(text) <= limit else text[: limit - 3] + "..."
