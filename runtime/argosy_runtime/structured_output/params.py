"""`StructuredOutputsParams`: what a request's output must match (vLLM's field names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A grammar or schema is compiled on the engine thread; bound its size so that one request
# cannot stall everyone else's steps for long.
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Exactly one of the constraint fields:

    - `json`: a JSON schema (dict or its JSON text); the output is one JSON value matching it;
    - `json_object`: True; the output is any JSON object;
    - `regex`: the output matches this regular expression (Rust `regex` syntax, anchored);
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark (or llama.cpp GBNF) context-free grammar.

    `disable_any_whitespace` makes JSON compact (no optional whitespace between tokens), which
    also keeps small models from looping on newlines.
    Raises ValueError naming the field for anything malformed.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {what}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        if self.json is not None:
            self.json = _schema_dict(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} is longer than {MAX_SPEC_CHARS} "
                                 "characters")
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
        """Identifies the compiled grammar: equal keys compile to the same matcher."""
        spec = {name: getattr(self, name) for name in
                ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")}
        return json.dumps(spec, sort_keys=True)


def _schema_dict(schema: object) -> dict[str, Any]:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if isinstance(schema, bool):  # JSON Schema allows true / false as whole schemas
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    if len(json.dumps(schema)) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
    return schema
