"""Compiling `StructuredOutputsParams` with llguidance, and one matcher per sequence.

llguidance (the Rust library vLLM and SGLang also use) parses incrementally with an Earley
parser over a lexer, so a grammar compiles in about a millisecond and a step's token mask over
a 49k-token vocabulary takes 0.02-1.5 ms (0.25 ms on average for JSON): there is no
per-schema automaton to precompute.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from argosy_runtime.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from argosy_runtime.tokenizer import Tokenizer

logger = logging.getLogger("argosy.structured_output")
T = TypeVar("T")

# llguidance's `initial_lexer_fuel` caps the size of any regex expression its lexer builds
# (the grammar's, and each derivative it takes while matching). Past it, the matcher fails
# ("too many expressions constructed", or "initial lexer configuration (grammar) too big").
# It is the one limit that bounds the per-step cost of a huge literal repetition: a mask
# step of `a{N}` costs about 2 ms per 10k of N on this CPU and needs about 4 fuel per
# repetition, so llguidance's default of 1,000,000 admits `a{200000}` at 50-90 ms a step,
# several times a whole decode step (~20 ms). 50,000 refuses `a{13000}` and beyond up front
# (400: the compile-time probe below hits it) and keeps what passes at about 2 ms a step
# median. Typical grammars need 100-4,000 (a JSON schema with 60 properties: ~3,800); the
# largest ordinary user is a big enum, ~12 per value: 4,000 string values still pass.
# (step_lexer_fuel, step_max_items, max_items_in_row, max_lexer_states, max_grammar_size do
# not bound `a{N}`: measured, no effect.) Table and command: docs/structured_outputs.md, "Cost limits".
INITIAL_LEXER_FUEL = 50_000


def parser_limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL)


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
        self._no_token_bytes = False  # llguidance could not read the tokenizer (token_bytes)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one sequence. Raises ValueError for an invalid spec."""
        return RequestGrammar(self._prototype(params).deep_copy(), self._vocab_size)

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError if the spec cannot compile; otherwise cache it."""
        self._prototype(params)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a (non-special) token stands for: a byte-level BPE token can hold part
        of a UTF-8 character, which its decoded text shows as U+FFFD. None for a special
        token or an id outside the vocabulary, or when llguidance cannot read the tokenizer
        (asked once)."""
        with self._lock:
            if self._no_token_bytes:
                return None
            try:
                ll_tokenizer = self._llguidance_tokenizer()
            except Exception as exc:  # logprobs must not fail where they worked without it
                self._no_token_bytes = True
                logger.warning("logprob bytes: llguidance cannot read this tokenizer (%s); "
                               "the bytes of each token's decoded text are given instead",
                               _one_line(str(exc)))
                return None
        if not 0 <= token_id < self._vocab_size or ll_tokenizer.is_special_token(token_id):
            return None
        return ll_tokenizer.decode_bytes([token_id])

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """(Under the lock.)"""
        import llguidance

        if self._ll_tokenizer is None:  # about 0.2 s for a 49k vocabulary, once
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                eos_token=self._eos_token_ids or None)
        return self._ll_tokenizer

    def _prototype(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = params.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            self._llguidance_tokenizer()
        matcher = _on_big_stack(lambda: self._build(params))
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A new matcher, checked (on a thread with a big stack: `_on_big_stack`)."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer, _llguidance_grammar(params),
                                       log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_one_line(matcher.get_error())}")
        matcher.compute_bitmask()  # a grammar that matches nothing fails only here
        if matcher.is_error():
            raise ValueError("structured_outputs: no output can match this grammar "
                             f"({_one_line(matcher.get_error())})")
        error = _probe(matcher, self._eos_token_ids, self._vocab_size)
        if error is not None:
            raise ValueError(f"structured_outputs: the grammar is too complex to follow "
                             f"({error}); use smaller repetition counts, lengths or nesting")
        return matcher


# llguidance builds a grammar with recursion as deep as its chains of rules: a Lark grammar
# `a: b`, `b: c`, ... of 2,800 rules (25k characters), or a JSON schema whose `$defs` refer
# one to the next 3,000 times (95k), overflowed a default 8 MiB thread stack and killed the
# whole server process (SIGSEGV) while the matcher was built. The longest chains that fit in
# MAX_SPEC_CHARS (12,500 rules; 3,100 $refs) need about 40 MiB; a thread stack is virtual
# memory, touched only as deep as it is used. Only the build recurses so: masks, deep copies
# and advances of such a grammar run on the engine's own stack (tested).
BUILD_STACK_BYTES = 256 * 2**20
_stack_size_lock = threading.Lock()


def _on_big_stack(build: Callable[[], T]) -> T:
    """`build()`, run on a new thread with a BUILD_STACK_BYTES stack; its exception is
    raised here."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # raised again in the caller's thread
            failure.append(exc)

    # threading.stack_size applies to the threads started after it: set it around this one
    with _stack_size_lock:
        previous = threading.stack_size(BUILD_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="argosy-grammar-build", daemon=True)
            thread.start()
        except RuntimeError as exc:  # no room for the stack (strict overcommit): build here
            logger.warning("grammar build on the caller's stack (%s)", exc)
            thread = None
        finally:
            threading.stack_size(previous)
    if thread is None:
        return build()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


class RequestGrammar:
    """One sequence's parser state. It follows the sequence's output tokens lazily: every call
    first brings the matcher to the given output (consuming new tokens, rolling back ones a
    speculative verification tried), so callers never track what it has seen.

    The matcher can fail mid-generation: llguidance bounds the work of each step (lexer fuel,
    lexer states, Earley items), and a grammar near those limits can pass `check` and exceed
    them later. A failed matcher never recovers; `error` says why, and the engine then ends the
    request with finish_reason "error" (never "stop": its output does not match)."""

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
                # a resource limit (or a token the mask did not allow): the request fails
                self._warned = True
                logger.warning("structured output failed: %s",
                               _one_line(self._matcher.get_error()))
            consumed.extend(new)

    def error(self, output_token_ids: Sequence[int]) -> str | None:
        """Why the matcher failed after this output (one line), or None while it is sound."""
        self.sync(output_token_ids)
        if not self._matcher.is_error():
            return None
        return _one_line(self._matcher.get_error())

    def allowed_tokens(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (only EOS once it is done).
        A failed matcher allows every token: its own mask (EOS alone), cut further by
        min_tokens or ignore_eos, could leave a row with no token at all; the engine ends the
        request with an error after this step, whatever it samples."""
        self.sync(output_token_ids)
        bitmask = self._matcher.compute_bitmask()
        if self._matcher.is_error():
            return torch.ones(self._vocab_size, dtype=torch.bool)
        return _allowed(bitmask, self._vocab_size)

    def is_done(self, output_token_ids: Sequence[int]) -> bool:
        """True once nothing but EOS may follow: the structured output is complete (a failed
        matcher is not done; see `error`)."""
        self.sync(output_token_ids)
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def forced_tokens(self, output_token_ids: Sequence[int]) -> list[int]:
        """Tokens the grammar forces next, in their canonical tokenization (llguidance stops
        before a token that could merge with what follows, so forcing never splits a word
        in a way the model was not trained on)."""
        self.sync(output_token_ids)
        return [] if self._matcher.is_error() else self._matcher.compute_ff_tokens()

    def valid_prefix(self, output_token_ids: Sequence[int], tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar would accept after the output, ending
        at the token that completes it, if one does: the request ends there (`is_done`), and
        a stopped matcher fails on any token fed after, EOS included, which `validate_tokens`
        still counts."""
        self.sync(output_token_ids)
        if not tokens:
            return tokens
        return self._to_end(tokens[: self._matcher.validate_tokens(tokens)])[0]

    def cut_at_end(self, output_token_ids: Sequence[int], tokens: list[int]) -> list[int]:
        """`tokens` cut after the token that completes the output, if their valid prefix
        holds one (nothing after it is output, and a stopped matcher fails on any token fed
        after it); else all of them, invalid ones included. For drafts verified against their
        draft's distribution q: cutting one at an invalid token would bias the residual
        sampling, while past the end no verification happens at all."""
        self.sync(output_token_ids)
        if not tokens:
            return tokens
        ended, complete = self._to_end(tokens[: self._matcher.validate_tokens(tokens)])
        return ended if complete else tokens

    def _to_end(self, valid: list[int]) -> tuple[list[int], bool]:
        """(`valid` up to the token that completes the output, whether one does)."""
        consumed = 0
        for token in valid:
            if self._matcher.is_stopped():
                break
            self._matcher.consume_token(token)
            consumed += 1
        complete = self._matcher.is_stopped()
        if consumed:
            self._matcher.rollback(consumed)
        return valid[:consumed], complete


def _probe(prototype: llguidance.LLMatcher, eos_token_ids: Sequence[int], vocab_size: int,
           num_steps: int = 3) -> str | None:
    """Follow a few tokens on a copy of a freshly compiled matcher (the lowest allowed token
    id each step) and return the error if it fails. Nothing the mask allows can fail except
    by a resource limit, and a grammar past llguidance's limits (`a{1000000}`, a `pattern`
    with a huge repetition) fails on its first token: this turns that into a 400 instead of
    a request that dies after one token. Costs one mask and one advance per step."""
    matcher = prototype.deep_copy()
    eos = [t for t in eos_token_ids if t < vocab_size]
    for _ in range(num_steps):
        if matcher.is_stopped():
            break
        bitmask = matcher.compute_bitmask()
        if matcher.is_error():
            break
        allowed = _allowed(bitmask, vocab_size)
        allowed[eos] = False
        tokens = allowed.nonzero()
        if len(tokens) == 0:  # only EOS may follow
            break
        matcher.consume_token(int(tokens[0]))
    return _one_line(matcher.get_error()) if matcher.is_error() else None


def _allowed(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """Bool [vocab_size] from llguidance's bitmask (int32 words, bit b of word w: token
    32 w + b)."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


# llguidance's `grammar_from("grammar", ...)` reads a text as Lark only where a line starts
# with `start:` (or `%llguidance`), and converts anything else from GBNF: a Lark grammar whose
# start rule is inlined (`?start: value`, the first line of Lark's own JSON example) or kept
# (`!start:`) was a 400 "Failed to convert the grammar from GBNF to Lark".
_LARK_INLINED_START = re.compile(r"(?m)^\s*[?!]start\s*:")


def _llguidance_grammar(params: StructuredOutputsParams) -> str:
    import llguidance

    options: dict[str, object] = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None and (params.json is not None
                                                  or params.json_object):
        # llguidance's matcher would report a bad pattern as the whole spec's error
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_regex(params.whitespace_pattern))
        if error:
            raise ValueError(f"structured_outputs.whitespace_pattern: {_one_line(error)}")
        options["whitespace_pattern"] = params.whitespace_pattern  # replaces the default
    if params.json is not None:
        schema = params.json
        if params.disable_additional_properties:
            schema = _without_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        if _LARK_INLINED_START.search(params.grammar):
            return llguidance.LLMatcher.grammar_from_lark(params.grammar)
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


# Where a JSON schema holds subschemas (as vLLM's `disable_additional_properties` walks them):
# maps of name -> schema, and keywords whose value is a schema or a list of schemas. Other
# values are data (`const`, `enum`, `default`, `examples`), never rewritten.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "additionalItems", "unevaluatedItems", "not", "if", "then", "else",
               "contentSchema", "items", "prefixItems", "allOf", "anyOf", "oneOf")


def _without_additional_properties(schema: dict) -> dict:
    """`schema` with `"additionalProperties": false` in every object schema that has
    `properties` or `patternProperties` but no `additionalProperties` (vLLM's
    `disable_additional_properties`). The rewritten schemas are copies (the request's own
    dict is left as it is); iterative, since a schema may nest as deep as the request parser
    allowed (copy.deepcopy would recurse)."""
    stack: list[dict] = []

    def copied(value: object) -> object:
        """A copy of a subschema (or of a list of them), queued to be rewritten."""
        if isinstance(value, list):
            return [copied(item) if isinstance(item, dict) else item for item in value]
        if isinstance(value, dict):
            value = dict(value)
            stack.append(value)
        return value  # a boolean schema, or a malformed one that llguidance will name

    root = copied(schema)
    while stack:
        node = stack.pop()
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: copied(sub) for name, sub in node[key].items()}
        for key in _SUBSCHEMAS:
            if isinstance(node.get(key), (dict, list)):
                node[key] = copied(node[key])
        if "additionalProperties" not in node and (isinstance(node.get("properties"), dict) or
                                                   isinstance(node.get("patternProperties"), dict)):
            node["additionalProperties"] = False
    return root


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's messages span lines (a caret under the error, a parser state dump after
    it); an API error is one line."""
    text = " ".join(message.split("<state>")[0].split()) or "invalid grammar"
    return text if len(text) <= limit else text[: limit - 3] + "..."
