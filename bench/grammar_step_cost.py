"""Per-step cost of a structured-output token mask, typical vs pathological grammars.

For each grammar, follows a valid output token by token and times `compute_bitmask()` (the
call `RequestGrammar.allowed_tokens` makes on the engine thread every step), under
llguidance's default limits and under Argosy's (`grammar.parser_limits()`). "refused" means
the matcher failed within the steps shown, which the compile-time probe turns into a 400.

    .venv/bin/python bench/grammar_step_cost.py
Results: docs/structured_outputs.md, "Cost limits".
"""

from __future__ import annotations

import argparse
import statistics
import time

import llguidance
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.structured_output.grammar import INITIAL_LEXER_FUEL, parser_limits

J = llguidance.LLMatcher.grammar_from_json_schema
R = llguidance.LLMatcher.grammar_from_regex
FLEX = {"whitespace_flexible": True}
NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Tokyo"]},
    "friends": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name"]}}},
    "required": ["name", "age", "city", "friends"], "additionalProperties": False}
TOOLS = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}, "required": ["name", "parameters"]},
    {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}},
     "required": ["name", "parameters"]}]}}
CASES = [  # (name, grammar, a valid output or a prefix of one)
    ("json schema, nested", J(NESTED, defaults=FLEX),
     '{"name": "Ann", "age": 31, "city": "Paris", "friends": [{"name": "Bob", "tags": ["a"]}]}'),
    ("json_object", J({"type": "object"}, defaults=FLEX),
     '{"a": [1, 2.5, {"b": null}], "c": "hello world", "d": true}'),
    ("tool call (tool_choice required)", J(TOOLS, defaults=FLEX),
     '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]'),
    ("enum of 4000 strings", J({"enum": [f"value number {i}" for i in range(4000)]}),
     '"value number 3999"'),
    ("regex [0-9]{3}-[0-9]{4}", R(r"[0-9]{3}-[0-9]{4}"), "555-1234"),
    ("regex, moderate", R(r"[A-Z][a-z]{2,20}( [A-Z][a-z]{2,20}){0,3}, [0-9]{1,5} [A-Za-z ]{3,40}"),
     "John Smith, 42 Baker Street"),
    ("a{200000}", R("a{200000}"), "a" * 400),
    ("a{50000}", R("a{50000}"), "a" * 400),
    ("a{12000}", R("a{12000}"), "a" * 400),
    ("(ab){50000}", R("(ab){50000}"), "ab" * 200),
    ("(a|b){100000}", R("(a|b){100000}"), "ab" * 200),
    ("[ab]{1000000}", R("[ab]{1000000}"), "ab" * 200),
    ('{"type": "string", "minLength": 100000}', J({"type": "string", "minLength": 100000}),
     '"' + "hello world " * 30),
    ('{"type": "string", "pattern": "^a{50000}$"}',
     J({"type": "string", "pattern": "^a{50000}$"}), '"' + "a" * 400),
]


def measure(ll_tokenizer, tokenizer, grammar: str, text: str, limits, steps: int) -> str:
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=limits)
    times = []
    for token in tokenizer.encode(text, add_special_tokens=False)[:steps]:
        if matcher.is_error():
            break
        start = time.perf_counter()
        matcher.compute_bitmask()
        times.append((time.perf_counter() - start) * 1e3)
        if matcher.is_error() or not matcher.consume_token(token):
            break
    if matcher.is_error():
        return f"refused after {len(times)} mask(s)"
    return f"{statistics.median(times):.2f} / {max(times):.2f} ({len(times)} steps)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    checkpoint = load_checkpoint("smollm2-135m")
    tokenizer = checkpoint.tokenizer
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                          n_vocab=checkpoint.spec.vocab_size,
                                          eos_token=sorted(tokenizer.eos_token_ids))
    print("| grammar | defaults: median / max ms per mask | initial_lexer_fuel "
          f"{INITIAL_LEXER_FUEL:,} |\n|---|---|---|")
    for name, grammar, text in CASES:
        default = measure(ll_tokenizer, tokenizer, grammar, text, None, args.steps)
        limited = measure(ll_tokenizer, tokenizer, grammar, text, parser_limits(), args.steps)
        name = name.replace("|", "\\|")  # a pipe inside a Markdown table cell
        print(f"| `{name}` | {default} | {limited} |", flush=True)


if __name__ == "__main__":
    main()
