"""Validate LLMDeployment objects the way the API server would, offline.

- `apply_defaults`: structural defaulting (a missing property with a `default` gets it, then
  nested defaults apply inside it), as the API server does before validation;
- `openapi_to_jsonschema`: the CRD's OpenAPI v3 schema as a JSON Schema (draft 4, whose
  boolean exclusiveMinimum/Maximum match OpenAPI 3.0), with unknown fields rejected like
  `kubectl apply` (server-side strict field validation) does, except under
  x-kubernetes-preserve-unknown-fields;
- `cel_errors`: every `x-kubernetes-validations` rule evaluated with cel-python on the node it
  is attached to (`self` bound to that node's value).
"""

from __future__ import annotations

import copy
import functools
import pathlib
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "llmdeployments.argosy.dev.yaml"


@functools.cache
def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A defaulted deep copy of `value` under `schema`."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in props:
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def openapi_to_jsonschema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, val in schema.items():
        if key.startswith("x-kubernetes-") or key in ("default", "description"):
            continue
        if key == "properties":
            out[key] = {k: openapi_to_jsonschema(v) for k, v in val.items()}
        elif key in ("items", "additionalProperties") and isinstance(val, dict):
            out[key] = openapi_to_jsonschema(val)
        elif key == "pattern" and val.endswith("$") and not val.endswith("\\$"):
            # The API server's Go regexps end `$` at the end of the text; Python's `$` also
            # matches before a final newline ("30s\n" would pass here and fail there).
            out[key] = val[:-1] + r"\Z"
        else:
            out[key] = val
    if schema.get("x-kubernetes-int-or-string"):
        string_part = {"type": "string"}
        if "pattern" in out:
            string_part["pattern"] = out.pop("pattern")
        out["anyOf"] = [{"type": "integer"}, string_part]
    if (out.get("type") == "object" and "properties" in out
            and not schema.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in out):
        out["additionalProperties"] = False
    return out


def schema_errors(obj: dict[str, Any]) -> list[str]:
    schema = openapi_to_jsonschema(openapi_schema())
    schema["properties"]["metadata"] = {"type": "object"}
    validator = jsonschema.Draft4Validator(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))]


def _rules(schema: dict[str, Any], value: Any, path: str
           ) -> Iterator[tuple[str, dict[str, Any], Any]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _rules(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


@functools.cache
def _program(expr: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expr))


def cel_errors(obj: dict[str, Any]) -> list[str]:
    """Messages of the CEL rules that `obj` (already defaulted) breaks."""
    errors = []
    for path, rule, value in _rules(openapi_schema(), obj, ""):
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if not isinstance(result, celpy.celtypes.BoolType):
            raise AssertionError(f"rule {rule['rule']!r} at {path} gave {result!r}")
        if not result:
            errors.append(f"{path.lstrip('.')}: {rule.get('message', rule['rule'])}")
    return errors


def validate(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the defaulted object, schema errors + CEL errors) as the API server would see it."""
    defaulted = apply_defaults(openapi_schema(), obj)
    errors = schema_errors(defaulted)
    if not errors:  # like the API server: CEL runs on schema-valid objects
        errors = cel_errors(defaulted)
    return defaulted, errors
