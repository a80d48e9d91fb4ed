"""Structured outputs and logit_bias through the official `openai` client: OpenAI's
`response_format` (json_object, json_schema, the client's pydantic `parse`), vLLM's
`structured_outputs` extra, streaming, and the same tokens as the offline engine."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
from argosy_runtime import SamplingParams, StructuredOutputsParams
from openai import OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=100)


MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_parse_with_a_pydantic_model_equals_the_offline_engine(client: OpenAI,
                                                               offline_llm) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City,
                                      temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    # The client sent City's JSON schema; the offline engine with that schema agrees exactly.
    schema = City.model_json_schema() | {"additionalProperties": False}
    expected = offline_llm.chat(MESSAGES, SamplingParams(
        temperature=0, max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=schema)))[0].outputs[0]
    assert choice.message.content == expected.text
    assert r.usage.completion_tokens == len(expected.token_ids)


def test_json_schema_stream_equals_non_stream(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
        "minItems": 2, "maxItems": 3}}, "required": ["colors"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": schema}}
    messages = [{"role": "user", "content": "Name primary colors as JSON."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=60, response_format=fmt)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=60, response_format=fmt,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len(chunks) > 4
    jsonschema.validate(json.loads(text), schema)


def test_json_object_with_n_and_seed(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, n=3, seed=11, temperature=0.8, max_tokens=60)
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: still a prefix of a JSON object
            assert choice.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in r.choices)


def test_structured_outputs_extra_on_completions(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:",
                                  max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.7, seed=3, stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit()


def test_logit_bias_forces_and_bans_tokens(client: OpenAI, offline_llm) -> None:
    tok = offline_llm.engine.tokenizer
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=4,
                                  temperature=0.9, logit_bias={str(banana): 100})
    assert r.choices[0].text == " banana" * 4
    free = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0)
    first = tok.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100})
    assert tok.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
