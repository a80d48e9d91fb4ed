"""GrammarCompiler / RequestGrammar on the embedded model's real tokenizer: the token masks
equal a brute-force check over the whole vocabulary, the matcher follows outputs forwards and
back, and specs that cannot compile are ValueErrors."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from argosy_runtime import StructuredOutputsParams
from argosy_runtime.structured_output.grammar import (
    INITIAL_LEXER_FUEL,
    GrammarCompiler,
    parser_limits,
)
from argosy_runtime.structured_output.params import (
    MAX_MULTIPLE_OF,
    MAX_SCHEMA_INTEGER,
    MIN_SCHEMA_INTEGER,
)

CHOICES = ["The capital is Paris.", "The capital is Lyon!", "Paris", "I do not know."]


@pytest.fixture(scope="module")
def token_texts(checkpoint) -> list[str]:
    tok = checkpoint.tokenizer
    special = set(tok.all_special_ids)
    return ["" if t in special else tok.decode([t], skip_special_tokens=False)
            for t in range(checkpoint.spec.vocab_size)]


def brute_force_allowed(output: str, token_texts: list[str], eos: int) -> set[int]:
    """Tokens after which the text is still a prefix of some choice (+ EOS once complete).
    Tokens with an empty text (special tokens) never advance the output, so they are out."""
    allowed = {t for t, text in enumerate(token_texts)
               if text and any(c.startswith(output + text) for c in CHOICES)}
    if output in CHOICES:
        allowed.add(eos)
    return allowed


def test_choice_masks_agree_with_a_brute_force_check(compiler, checkpoint, token_texts) -> None:
    """Where the choices branch (the first token) the mask is exactly the brute-force set; once
    the grammar forces the next bytes, llguidance allows only their canonical tokenization, a
    subset. Every allowed token keeps the text a prefix of a choice, the canonical next token is
    always allowed, and EOS exactly when a choice is complete."""
    tok = checkpoint.tokenizer
    eos = tok.eos_token_ids[0]
    grammar = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    first = set(torch.nonzero(grammar.allowed_tokens([])).flatten().tolist())
    assert first == brute_force_allowed("", token_texts, eos)
    assert len(first) >= 5  # "T", "The", "P", "Paris", "I", ...
    for choice in CHOICES:
        ids = tok.encode(choice, add_special_tokens=False)
        for n in range(len(ids) + 1):
            mask = grammar.allowed_tokens(ids[:n])
            assert mask.dtype == torch.bool and mask.shape == (checkpoint.spec.vocab_size,)
            got = set(torch.nonzero(mask).flatten().tolist())
            want = brute_force_allowed(tok.decode(ids[:n]), token_texts, eos)
            assert got and got <= want, (choice, n, sorted(got - want)[:10])
            assert (ids[n] if n < len(ids) else eos) in got
            assert (eos in got) == (n == len(ids))


def test_regex_mask_equals_a_brute_force_check(compiler, checkpoint, token_texts) -> None:
    """Thousands of allowed tokens spread over the whole vocabulary: any slip in unpacking the
    bitmask (bit order, word order, vocabulary end) shows here."""
    tok = checkpoint.tokenizer
    grammar = compiler.compile(StructuredOutputsParams(regex="[a-z ]+"))
    letters = set("abcdefghijklmnopqrstuvwxyz ")
    for output in ["", " hello"]:
        ids = tok.encode(output, add_special_tokens=False)
        got = set(torch.nonzero(grammar.allowed_tokens(ids)).flatten().tolist())
        want = {t for t, text in enumerate(token_texts) if text and set(text) <= letters}
        if output:
            want.add(tok.eos_token_ids[0])
        assert got == want, sorted(got ^ want)[:10]
        assert len(got) > 10_000


def test_follows_outputs_forwards_and_back(compiler, checkpoint) -> None:
    tok = checkpoint.tokenizer
    ids = tok.encode(CHOICES[0], add_special_tokens=False)
    params = StructuredOutputsParams(choice=CHOICES)
    grammar = compiler.compile(params)
    masks = [grammar.allowed_tokens(ids[:n]) for n in range(len(ids) + 1)]
    # Back to the start, then a jump of several tokens, then a branch that replaces a token.
    assert torch.equal(grammar.allowed_tokens([]), masks[0])
    assert torch.equal(grammar.allowed_tokens(ids[:3]), masks[3])
    lyon = tok.encode(CHOICES[1], add_special_tokens=False)
    assert lyon[:3] == ids[:3] and lyon[3] != ids[3]
    fresh = compiler.compile(params)
    assert torch.equal(grammar.allowed_tokens(lyon[:4]), fresh.allowed_tokens(lyon[:4]))
    assert torch.equal(grammar.allowed_tokens(ids[:2]), masks[2])
    assert grammar.is_done(ids)
    assert not grammar.is_done(ids[:-1])


def test_done_only_when_nothing_but_eos_may_follow(compiler, checkpoint) -> None:
    tok = checkpoint.tokenizer
    grammar = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    paris = tok.encode("Paris", add_special_tokens=False)
    assert grammar.is_done(paris)  # no other choice starts with "Paris": only EOS may follow
    regex = compiler.compile(StructuredOutputsParams(regex="a+"))
    a = tok.encode("a", add_special_tokens=False)
    assert regex.allowed_tokens(a)[tok.eos_token_ids[0]]  # complete: it may end here,
    assert not regex.is_done(a)  # but more "a"s may follow


def test_valid_prefix_cuts_drafts_at_the_first_invalid_token(compiler, checkpoint) -> None:
    tok = checkpoint.tokenizer
    grammar = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    ids = tok.encode(CHOICES[0], add_special_tokens=False)
    bad = tok.encode(" Berlin", add_special_tokens=False)
    assert grammar.valid_prefix(ids[:2], ids[2:]) == ids[2:]
    assert grammar.valid_prefix(ids[:2], ids[2:4] + bad) == ids[2:4]
    assert grammar.valid_prefix(ids[:2], []) == []


def test_valid_prefix_ends_at_the_token_that_completes_the_output(compiler, checkpoint) -> None:
    """A draft past the output's end is cut there: the request ends with that token (is_done),
    and a stopped matcher fails for good on whatever is fed after it, EOS included, though
    llguidance's validate_tokens still counts that EOS (a speculative verification fed it, and
    a copy of the target as its draft failed sampled JSON requests mid-object)."""
    tok = checkpoint.tokenizer
    grammar = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    lyon = tok.encode(CHOICES[1], add_special_tokens=False)  # the only choice it starts
    assert len(lyon) > 2
    eos = tok.eos_token_ids[0]
    assert grammar.valid_prefix(lyon[:1], lyon[1:] + [eos, eos]) == lyon[1:]
    # Drafts with a draft model's q: cut at the end only, never at an invalid token.
    berlin = tok.encode(" Berlin", add_special_tokens=False)
    assert grammar.cut_at_end(lyon[:1], lyon[1:] + [eos]) == lyon[1:]
    assert grammar.cut_at_end(lyon[:1], berlin + lyon[1:] + [eos]) == berlin + lyon[1:] + [eos]
    assert grammar.error(lyon) is None and grammar.is_done(lyon)  # untouched by the checks


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"regex": "("}, "unclosed group"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable schema"),
    ({"json": {"type": "foo"}}, "Invalid type: foo"),
    ({"json": {"properties": {"a": {"$ref": "#/nope"}}}}, "/nope"),
    ({"grammar": "start: x\nx: x"}, "no output can match this grammar"),
    ({"grammar": "value ::= \"a\""}, "structured_outputs.grammar"),  # GBNF without root
    # past llguidance's lexer limits: these compile, then fail on their first token (the
    # fuzzed "a{1000000}" used to end after one token as a normal "stop")
    ({"regex": "a{1000000}"}, "too complex to follow .*too many expressions"),
    ({"json": {"type": "string", "pattern": "^a{1000000}$"}}, "too complex to follow"),
    ({"grammar": 'start: "b" "b" "b" "b" "b" A\nA: /a{1000000}/'}, "too complex to follow"),
    # within llguidance's default limits, but 10-90 ms a mask step on the engine thread:
    # refused by INITIAL_LEXER_FUEL (see grammar.py)
    ({"regex": "a{200000}"}, "too complex to follow .*too many expressions"),
    ({"regex": "a{50000}"}, "too complex to follow .*too many expressions"),
    ({"regex": "(ab){50000}"}, "too complex to follow .*too many expressions"),
    ({"json": {"type": "string", "pattern": "^a{50000}$"}}, "too complex to follow"),
    ({"json": {"enum": [f"value {i}" for i in range(6000)]}}, "grammar\\) too big"),
])
def test_specs_that_cannot_compile_are_value_errors(compiler, kwargs: dict, message: str) -> None:
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=message) as info:
        compiler.check(params)
    assert "\n" not in str(info.value) and str(info.value).startswith("structured_outputs")
    with pytest.raises(ValueError, match=message):
        compiler.compile(params)


def test_integers_at_the_edges_of_the_supported_range_compile(compiler) -> None:
    """llguidance 1.9 dies with SIGSEGV building a matcher for an integer that rounds to -2**63
    as an f64 (`{"const": -9223372036854775808}`, and up to -2**63 + 512): params refuse those
    (test_params.py). The bounds themselves compile; were a bound one off, this test process
    would crash."""
    for value in (MIN_SCHEMA_INTEGER, 2**63 - 1, MAX_SCHEMA_INTEGER):
        compiler.check(StructuredOutputsParams(json={"const": value}))
        compiler.check(StructuredOutputsParams(json={"enum": [value, 1]}))
    compiler.check(StructuredOutputsParams(
        grammar=f'start: %json{{"const": {MIN_SCHEMA_INTEGER}}}'))
    # without %json a long number is only a literal: no integer check
    compiler.check(StructuredOutputsParams(grammar='start: "-9223372036854775808"'))


@pytest.mark.parametrize("multiple_of", [MAX_MULTIPLE_OF, 9973, 8192, 3125, 0.01, 0.9973, 1e-7])
def test_multiple_of_up_to_the_limit_compiles_fast(compiler, multiple_of: float) -> None:
    """Within MAX_MULTIPLE_OF (primes and powers of 2 and 5 are the slowest) a compile is
    fast; past it params refuse (test_params.py): 999983 took ~7 s, 2**24 over 20 s."""
    start = time.perf_counter()
    for kind in ("integer", "number"):
        compiler.check(StructuredOutputsParams(json={"type": kind, "multipleOf": multiple_of}))
    assert time.perf_counter() - start < 2.0


def test_compiles_concurrently_from_several_threads(checkpoint) -> None:
    compiler = GrammarCompiler(checkpoint.tokenizer, checkpoint.spec.vocab_size, [2],
                               cache_size=3)
    specs = [StructuredOutputsParams(regex=f"[0-9]{{{n}}}") for n in range(1, 13)]
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(compiler.compile, specs))
    digit = checkpoint.tokenizer.encode("7", add_special_tokens=False)
    for n, grammar in enumerate(grammars, 1):
        assert grammar.is_done(digit * n) and not grammar.is_done(digit * (n - 1))


def test_a_matcher_that_fails_mid_generation_reports_it(compiler, checkpoint) -> None:
    """A schema that passes the compile-time probe (which follows the lowest token ids: `[`
    and whitespace) and fails once the output reaches its huge `pattern`: the matcher says
    why, is not "done", forces nothing, and allows every token (its own mask, EOS alone,
    could leave a row with none once min_tokens or ignore_eos removes EOS)."""
    tok = checkpoint.tokenizer
    grammar = compiler.compile(StructuredOutputsParams(json=FAILS_MID_GENERATION))
    ids = tok.encode('[1, "aaaa', add_special_tokens=False)
    assert grammar.error(ids[:-1]) is None and not grammar.is_done(ids[:-1])
    assert grammar.allowed_tokens(ids[:-1])[ids[-1]]  # the mask allowed the failing token
    error = grammar.error(ids)
    assert error == "lexer error: too many expressions constructed"
    assert not grammar.is_done(ids)
    assert grammar.forced_tokens(ids) == []
    assert bool(grammar.allowed_tokens(ids).all())
    assert grammar.error(ids[:-1]) is not None  # a failed matcher never recovers


# An array whose second item must match a regex past llguidance's lexer limits.
FAILS_MID_GENERATION = {"type": "array", "minItems": 2, "prefixItems": [
    {"type": "integer"}, {"type": "string", "pattern": "^a{1000000}$"}]}


def test_the_fuel_limit_is_what_refuses_a_huge_repetition(checkpoint) -> None:
    """`a{50000}` (a 400 above) is followed without error under llguidance's default limits,
    at 10-50 ms a mask step: INITIAL_LEXER_FUEL is what refuses it. The largest repetition it
    admits stays a valid grammar (its steps cost about 2 ms; see grammar.py)."""
    import llguidance

    tok = checkpoint.tokenizer
    ll_tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=checkpoint.spec.vocab_size,
                                          eos_token=sorted(tok.eos_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_regex("a{50000}")
    a = tok.encode("a" * 64, add_special_tokens=False)
    default = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert default.consume_tokens(a[:2]) and not default.is_error()
    limited = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())
    assert parser_limits().initial_lexer_fuel == INITIAL_LEXER_FUEL
    limited.compute_bitmask()
    assert not limited.consume_tokens(a[:2])
    assert "too many expressions" in limited.get_error()
    compiler = GrammarCompiler(tok, checkpoint.spec.vocab_size, tok.eos_token_ids)
    assert compiler.compile(StructuredOutputsParams(regex="a{12000}")).error(a) is None


TYPICAL = [  # (spec, a valid output)
    ({"json": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "friends": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
            "required": ["name"]}}},
        "required": ["name", "age", "city", "friends"], "additionalProperties": False}},
     '{"name": "Ann", "age": 31, "city": "Paris", "friends": [{"name": "Bob", "tags": ["a"]}]}'),
    ({"json_object": True}, '{"a": [1, 2.5, {"b": null}], "c": "hello world", "d": true}'),
    ({"json": {"type": "array", "minItems": 1, "items": {"anyOf": [  # tool_choice "required"
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"]}}, "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}}},
         "required": ["name", "parameters"]}]}}},
     '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]'),
    ({"json": {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"}, "mail": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "url": {"type": "string", "pattern": "^https?://[a-z0-9.-]+(/[a-zA-Z0-9_./-]*)?$"}}}},
     '{"when": "2024-01-01T10:00:00Z", "mail": "a@b.com", "url": "https://x.org/a"}'),
    ({"json": {"type": "object", "properties": {
        f"field_{i}": {"type": ["string", "integer", "null"], "maxLength": 64} for i in range(60)}}},
     '{"field_0": "x", "field_59": 12}'),
    ({"json": {"enum": [f"value number {i}" for i in range(4000)]}}, '"value number 3999"'),
    ({"json": {"type": "string", "maxLength": 1000}}, '"' + "hello world " * 20 + '"'),
    ({"regex": r"[A-Z][a-z]{2,20}( [A-Z][a-z]{2,20}){0,3}, [0-9]{1,5} [A-Za-z ]{3,40}"},
     "John Smith, 42 Baker Street"),
    ({"regex": "(abc){1000}"}, "abc" * 40),
    ({"regex": "[ab]{1000000}"}, "ab" * 40),  # character classes repeat cheaply: not limited
]


@pytest.mark.parametrize(("kwargs", "text"), TYPICAL)
def test_typical_grammars_get_the_same_masks_as_without_the_limit(
        compiler, checkpoint, kwargs: dict, text: str) -> None:
    """Each step's mask along a valid output equals the mask under llguidance's defaults."""
    import llguidance

    tok = checkpoint.tokenizer
    grammar = compiler.compile(StructuredOutputsParams(**kwargs))
    reference = llguidance.LLMatcher(compiler._ll_tokenizer, _grammar_of(kwargs), log_level=0)
    ids = tok.encode(text, add_special_tokens=False)
    for i in range(len(ids) + 1):
        expected = torch.frombuffer(bytearray(reference.compute_bitmask()), dtype=torch.int32)
        bits = ((expected[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        assert torch.equal(grammar.allowed_tokens(ids[:i]), bits[: checkpoint.spec.vocab_size])
        assert grammar.error(ids[:i]) is None
        if i < len(ids):
            assert reference.consume_token(ids[i])


def _grammar_of(kwargs: dict) -> str:
    from argosy_runtime.structured_output.grammar import _llguidance_grammar

    return _llguidance_grammar(StructuredOutputsParams(**kwargs))


def test_schemas_that_differ_only_in_property_order_are_not_one_grammar(
        compiler, checkpoint) -> None:
    """The output writes properties in the schema's order (a "reasoning" before its
    "answer"): a schema must not get the cached grammar of its reordered twin."""
    tok = checkpoint.tokenizer
    props = {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}
    first, second = ({"type": "object", "properties": dict(order),
                      "required": ["answer", "reasoning"], "additionalProperties": False}
                     for order in (props.items(), reversed(props.items())))
    for schema, text in ((first, '{"reasoning":"x","answer":1}'),
                         (second, '{"answer":1,"reasoning":"x"}')):
        grammar = compiler.compile(StructuredOutputsParams(json=schema,
                                                           disable_any_whitespace=True))
        ids = tok.encode(text, add_special_tokens=False)
        assert all(grammar.allowed_tokens(ids[:n])[ids[n]] for n in range(len(ids))), text
        assert grammar.is_done(ids)


def test_token_bytes_give_up_once_when_llguidance_cannot_read_the_tokenizer(
        checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Chat logprobs ask for the bytes of a token that splits a character: a tokenizer
    llguidance cannot read gives None (the server then encodes the text), once, not a 500
    on every such token."""
    compiler = GrammarCompiler(checkpoint.tokenizer, checkpoint.spec.vocab_size,
                               checkpoint.tokenizer.eos_token_ids)
    calls = []

    def unreadable() -> None:
        calls.append(1)
        raise RuntimeError("unsupported tokenizer")

    monkeypatch.setattr(compiler, "_llguidance_tokenizer", unreadable)
    assert compiler.token_bytes(100) is None
    assert compiler.token_bytes(101) is None
    assert calls == [1]


def _matches(compiler: GrammarCompiler, tok, params: StructuredOutputsParams,  # noqa: ANN001
             text: str) -> bool:
    """Whether the grammar allows `text`'s tokens one by one and is complete after them."""
    grammar = compiler.compile(params)
    ids = tok.encode(text, add_special_tokens=False)
    return (all(grammar.allowed_tokens(ids[:n])[ids[n]] for n in range(len(ids)))
            and grammar.is_done(ids))


def test_disable_additional_properties_refuses_unlisted_properties_at_every_level(
        compiler: GrammarCompiler, checkpoint) -> None:  # noqa: ANN001
    """vLLM's option: objects with `properties` take no others where the schema does not say
    (JSON Schema's default takes any). Subschemas are found under properties, $defs, items
    and anyOf; values that are data (`const`) are not schemas and stay as written."""
    tok = checkpoint.tokenizer
    schema = {
        "type": "object",
        "properties": {
            "city": {"$ref": "#/$defs/city"},
            "tags": {"type": "array", "items": {"type": "object",
                                                "properties": {"t": {"type": "string"}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"n": {"type": "integer"}}},
                                 {"type": "null"}]},
            "free": {"type": "object", "properties": {}, "additionalProperties": True},
            "data": {"const": {"properties": {"x": 1}}},
        },
        "$defs": {"city": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    before = json.dumps(schema)
    strict = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    lax = StructuredOutputsParams(json=schema)
    valid = ('{"city": {"name": "Paris"}, "tags": [{"t": "x"}], "either": {"n": 1}, '
             '"free": {"any": 1}, "data": {"properties": {"x": 1}}}')
    assert _matches(compiler, tok, strict, valid)
    extras = ['{"extra": 1}', '{"city": {"name": "Paris", "extra": 1}}',
              '{"tags": [{"t": "x", "extra": 1}]}', '{"either": {"n": 1, "extra": 1}}']
    for text in extras:
        assert _matches(compiler, tok, lax, text), text  # (compiled from the same cache)
        assert not _matches(compiler, tok, strict, text), text
    assert json.dumps(schema) == before  # the caller's schema is not rewritten


def test_whitespace_pattern_replaces_the_default_whitespace(
        compiler: GrammarCompiler, checkpoint) -> None:  # noqa: ANN001
    """vLLM's `whitespace_pattern`: the whitespace allowed between JSON tokens (none is
    always allowed)."""
    tok = checkpoint.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for spec in ({"json": schema}, {"json_object": True}):
        one_space = StructuredOutputsParams(**spec, whitespace_pattern="[ ]?")
        assert _matches(compiler, tok, one_space, '{"a":1}')
        assert _matches(compiler, tok, one_space, '{ "a": 1 }')
        for text in ('{\n"a": 1}', '{"a":  1}'):
            assert _matches(compiler, tok, StructuredOutputsParams(**spec), text), text
            assert not _matches(compiler, tok, one_space, text), text
    newlines = StructuredOutputsParams(json=schema, whitespace_pattern="\n+")
    assert _matches(compiler, tok, newlines, '{\n\n"a":\n1}')
    assert not _matches(compiler, tok, newlines, '{"a": 1}')


def test_an_invalid_whitespace_pattern_names_its_field(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs.whitespace_pattern: .*unclosed"):
        compiler.check(StructuredOutputsParams(json_object=True, whitespace_pattern="[a-"))
