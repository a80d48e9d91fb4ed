"""`StructuredOutputsParams`: what a request's output must match (vLLM's field names)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

# A grammar or schema is compiled on the engine thread; bound its size so that one request
# cannot stall everyone else's steps for long.
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 1024
# A schema nested past Python's recursion limit cannot be parsed or measured here (llguidance
# refuses anything past ~128 levels anyway: "recursion limit exceeded").
_TOO_DEEP = "structured_outputs.json is nested too deeply"
# The integers llguidance (1.9) can take in a JSON schema. It converts them to i64/u64 and
# f64: one that rounds to -2**63 as an f64 (-2**63 + 512 and below; e.g. {"const":
# -9223372036854775808}) kills the whole server process (SIGSEGV) while the matcher is built,
# and one outside i64/u64 is "Value is not JSON serializable", naming no field.
MIN_SCHEMA_INTEGER = -(2**63) + 513
MAX_SCHEMA_INTEGER = 2**64 - 1
# llguidance builds a number's `multipleOf` into a lexer automaton whose size grows with the
# value's digits (read as an integer: 0.25 -> 25, 86400 -> 86400), outside the lexer fuel
# that bounds every other regex (grammar.py): {"type": "integer", "multipleOf": 999983}
# takes ~7 s to compile, 99991000 ~1 min, 16777216 (2**24) over 20 s and 1.5 GB, 2**31
# longer than anyone waited, each pinning a worker thread and a core. Up to 10,000 compiles
# in under 0.05 s whatever the digits; typical schemas use 0.01, 0.5, 5, 100, 1000.
MAX_MULTIPLE_OF = 10_000
# A %json{...} schema inside a grammar, and the numbers in it that need the same checks.
_JSON_IN_GRAMMAR = re.compile(r"%json\b")
_LONG_INTEGER = re.compile(r"-?[0-9]{19,4000}")  # int() takes at most 4300 digits
_MULTIPLE_OF = re.compile(r'"multipleOf"\s*:\s*(-?[0-9][0-9.eE+-]{0,40})')


@dataclass
class StructuredOutputsParams:
    """Exactly one of the constraint fields:

    - `json`: a JSON schema (dict or its JSON text); the output is one JSON value matching it;
    - `json_object`: True; the output is any JSON object;
    - `regex`: the output matches this regular expression (Rust `regex` syntax, anchored);
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark (or llama.cpp GBNF) context-free grammar.

    Options for `json` and `json_object` (vLLM's; ignored with the others, as in vLLM):

    - `disable_any_whitespace` makes JSON compact (no optional whitespace between tokens),
      which also keeps small models from looping on newlines;
    - `whitespace_pattern`: a regex (Rust `regex` syntax) for the whitespace allowed between
      JSON tokens instead of the default `[\\x20\\x0A\\x0D\\x09]+`; there may always be
      none;
    - `disable_additional_properties`: an object schema with `properties` (or
      `patternProperties`) and no `additionalProperties` takes no other properties (JSON
      Schema's default would allow any).

    Raises ValueError naming the field for anything malformed.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {what}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a boolean")
        if self.whitespace_pattern is not None:
            # "" is allowed: no whitespace at all, as with outlines (vLLM's first backend)
            if (not isinstance(self.whitespace_pattern, str)
                    or len(self.whitespace_pattern) > MAX_SPEC_CHARS):
                raise ValueError("structured_outputs.whitespace_pattern must be a string of at "
                                 f"most {MAX_SPEC_CHARS} characters")
            if self.disable_any_whitespace:  # llguidance would follow the pattern: say so
                raise ValueError("structured_outputs.whitespace_pattern cannot be used with "
                                 "disable_any_whitespace")
        if self.json is not None:
            self.json = _schema_dict(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} is longer than {MAX_SPEC_CHARS} "
                                 "characters")
        if self.grammar is not None and _JSON_IN_GRAMMAR.search(self.grammar):
            for match in _LONG_INTEGER.finditer(self.grammar):  # the same crash as in `json`
                _check_integer(int(match.group()), "grammar")
            for match in _MULTIPLE_OF.finditer(self.grammar):  # and the same slow compile
                try:
                    value = json.loads(match.group(1))
                except ValueError:  # not a number: llguidance's error names it
                    continue
                _check_multiple_of(value, "grammar")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or len(self.choice) > MAX_CHOICES):
                raise ValueError("structured_outputs.choice must be a list of 1 to "
                                 f"{MAX_CHOICES} strings")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice[{i}] must be a non-empty string")

    @property
    def key(self) -> str:
        """Identifies the compiled grammar: equal keys compile to the same matcher. Not
        sorted: the order of a schema's `properties` is the order its output writes them
        (reasoning before answer), so two orders are two grammars."""
        spec = {name: getattr(self, name) for name in
                ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                 "whitespace_pattern", "disable_additional_properties")}
        return json.dumps(spec)


def _schema_dict(schema: object) -> dict[str, Any]:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        except RecursionError:  # "[[[[..." in 100k characters: Python's parser recurses
            raise ValueError(_TOO_DEEP) from None
    if isinstance(schema, bool):  # JSON Schema allows true / false as whole schemas
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    try:
        size = len(json.dumps(schema))
    except RecursionError:  # a dict as deep as the request body's parser allowed
        raise ValueError(_TOO_DEEP) from None
    if size > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
    stack: list[Any] = [schema]  # every value, keywords llguidance ignores too (no recursion)
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
            _check_multiple_of(value.get("multipleOf"), "json")
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            _check_integer(value, "json")
    return schema


def _check_multiple_of(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # not a number: llguidance's own error names it
    if isinstance(value, int):  # (no float(): 10**400 would overflow)
        digits = abs(value)
    elif not math.isfinite(value):  # NaN / Infinity (Python's JSON reads them)
        return
    elif value.is_integer():
        digits = abs(int(value))
    else:  # 0.25 -> 25: its significant digits
        digits = int("".join(map(str, Decimal(repr(value)).normalize().as_tuple().digits)))
    if digits > MAX_MULTIPLE_OF:
        raise ValueError(f"structured_outputs.{name}: multipleOf {_short(value)} has too many "
                         f"digits (at most {MAX_MULTIPLE_OF} read as an integer: it is "
                         "compiled into an automaton that grows with them)")


def _check_integer(value: int, name: str) -> None:
    if not MIN_SCHEMA_INTEGER <= value <= MAX_SCHEMA_INTEGER:
        raise ValueError(f"structured_outputs.{name}: the integer {_short(value)} is out of "
                         f"the supported range [{MIN_SCHEMA_INTEGER}, {MAX_SCHEMA_INTEGER}]")


def _short(value: float) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
