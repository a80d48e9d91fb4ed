"""Schema fuzzing: request bodies generated from the server's own OpenAPI document (valid,
almost valid, and junk) never get a 5xx, and every error has the OpenAI error shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

STATUSES: list[int] = []

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)

# Fields whose valid values would make generation long: kept small, but still off by one.
def _mostly(valid: Any, invalid: Any) -> Any:
    return st.one_of(*[valid] * 6, invalid)


SMALL = {
    "max_tokens": _mostly(st.integers(1, 3), st.integers(-2, 0) | st.sampled_from(["x", 1.5])),
    "max_completion_tokens": _mostly(st.integers(1, 3), st.integers(-2, 0) | st.none()),
    "n": _mostly(st.integers(1, 3), st.sampled_from([0, -1, 17, 10**6])),
    "min_tokens": _mostly(st.integers(0, 1), st.integers(-3, -1)),
    "model": _mostly(st.just(MODEL), st.sampled_from(["other-model", ""]) | st.none()),
}


def strategy_for(schema: dict[str, Any], spec: dict[str, Any], depth: int = 0) -> Any:
    """A hypothesis strategy producing values that (mostly) follow a JSON schema."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return strategy_for(spec["components"]["schemas"][name], spec, depth)
    if "anyOf" in schema:
        return st.one_of([strategy_for(s, spec, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return _mostly(st.sampled_from(schema["enum"]), st.just("not-" + str(schema["enum"][0])))
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        lo, hi = schema.get("minimum", -5), schema.get("maximum", 60)
        return _mostly(st.integers(lo, min(hi, lo + 60)),
                       st.sampled_from([lo - 1, min(hi, lo + 60) + 1, 2**64, -(2**64)]))
    if kind == "number":
        lo, hi = schema.get("minimum", -3.0), schema.get("maximum", 3.0)
        return _mostly(st.floats(lo, hi), st.sampled_from([lo - 1, hi + 1, 1e308, -1e308]))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = strategy_for(schema.get("items", {}), spec, depth + 1) if depth < 3 else JUNK
        return st.lists(items, min_size=0, max_size=3)
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        props = {}
        for key, sub in schema["properties"].items():
            base = SMALL.get(key) if depth == 0 and key in SMALL else strategy_for(sub, spec,
                                                                                   depth + 1)
            # mostly well-typed, so that whole bodies are often valid and reach the engine
            props[key] = base if key in SMALL else st.one_of(*[base] * 9, JUNK)
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items()
                                               if k not in required})
    if kind == "object":
        return st.dictionaries(st.text(max_size=5), JUNK, max_size=2)
    return JUNK


def bounded(body: Any, chat: bool) -> Any:
    """Never leave the output length open-ended (it would run to max_model_len)."""
    if isinstance(body, dict):
        keys = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
        if all(body.get(k) is None for k in keys):
            body["max_tokens"] = 2
    return body


@pytest.fixture(scope="module")
def openapi(http: httpx.Client) -> dict[str, Any]:
    return http.get("/openapi.json").json()


BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2},
}


def _props(spec: dict[str, Any], path: str) -> dict[str, Any]:
    ref = _body_schema(spec, path)["$ref"].rsplit("/", 1)[-1]
    return spec["components"]["schemas"][ref]["properties"]


def _body_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    content = spec["paths"][path]["post"]["requestBody"]["content"]
    return content["application/json"]["schema"]


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_schema_fuzz_never_5xx(http: httpx.Client, openapi: dict[str, Any], data) -> None:
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    schema_body = strategy_for(_body_schema(openapi, path), openapi)
    extra = st.dictionaries(st.sampled_from(["foo", "best_of", "echo", "logit_bias", "x"]), JUNK,
                            max_size=1)
    # Half the bodies are a valid request with one or two fields replaced by schema-drawn
    # values (so many reach the engine); the rest are drawn whole from the schema, or junk.
    base = BASES[path]
    mutated = st.builds(lambda b, keys: {**base, **{k: b[k] for k in keys if k in b}},
                        schema_body, st.lists(st.sampled_from(sorted(_props(openapi, path))),
                                              min_size=1, max_size=2))
    body = data.draw(st.one_of(
        mutated, mutated, mutated, mutated, mutated, mutated, schema_body,
        st.builds(lambda b, e: {**b, **e}, schema_body, extra), JUNK))
    body = bounded(body, chat="chat" in path)
    raw = json.dumps(body).encode()
    if data.draw(st.sampled_from([False] * 19 + [True])):  # now and then, cut it short
        raw = raw[: max(1, len(raw) // 2)]
    r = http.post(path, content=raw, headers={"content-type": "application/json"}, timeout=120)
    STATUSES.append(r.status_code)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
    elif isinstance(body, dict) and body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]
    else:
        assert r.json()["choices"], r.text


def test_fuzz_reached_the_engine() -> None:
    """The fuzzer is only worth something if some bodies were valid and generated text."""
    if not STATUSES:
        pytest.skip("the fuzz test did not run in this session")
    assert STATUSES.count(200) >= 5, sorted(set(STATUSES))
    assert sum(400 <= s < 500 for s in STATUSES) >= 20
