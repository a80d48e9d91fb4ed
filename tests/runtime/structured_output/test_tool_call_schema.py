"""The grammar of tool_choice "required" (server/tool_calls.py) on the embedded model's real
tokenizer: each tool's local `$ref`s resolve against that tool's own parameters schema, not
against the array of calls the output is."""

from __future__ import annotations

import pytest
from argosy_runtime.server.protocol import ChatCompletionRequest
from argosy_runtime.server.tool_calls import tool_call_constraint
from argosy_runtime.structured_output.grammar import GrammarCompiler


def _item(p: dict) -> dict:
    return {"type": "object", "properties": p, "required": list(p),
            "additionalProperties": False}


# Two pydantic-style tools whose nested models share a name but not a shape, a draft-07 tool
# ("definitions"), and a recursive one ("#": its own parameters).
TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {
        **_item({"x": {"$ref": "#/$defs/Item"}}),
        "$defs": {"Item": _item({"p": {"type": "integer"}})}}}},
    {"type": "function", "function": {"name": "b", "parameters": {
        **_item({"y": {"$ref": "#/$defs/Item"}}),
        "$defs": {"Item": _item({"q": {"type": "boolean"}})}}}},
    {"type": "function", "function": {"name": "c", "parameters": {
        **_item({"z": {"$ref": "#/definitions/Z"}}), "definitions": {"Z": {"type": "null"}}}}},
    {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                         "v": {"type": "integer"}},
        "required": ["v"], "additionalProperties": False}}},
]


def _accepts(compiler: GrammarCompiler, tokenizer, text: str,
             req: ChatCompletionRequest | None = None) -> bool:
    """Whether the tool-call grammar of `req` (default: TOOLS, "required") takes `text` as a
    whole output, token by token."""
    req = req or ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                       tools=TOOLS, tool_choice="required")
    params = tool_call_constraint(req)
    params.disable_any_whitespace = True
    grammar = compiler.compile(params)
    out: list[int] = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.allowed_tokens(out)[token]:
            return False
        out.append(token)
    return grammar.is_done(out)


@pytest.mark.parametrize(("text", "ok"), [
    ('[{"name":"a","parameters":{"x":{"p":1}}}]', True),
    ('[{"name":"b","parameters":{"y":{"q":true}}}]', True),
    ('[{"name":"a","parameters":{"x":{"q":true}}}]', False),  # b's Item, not a's
    ('[{"name":"c","parameters":{"z":null}}]', True),
    ('[{"name":"tree","parameters":{"kids":[{"kids":[],"v":2}],"v":1}}]', True),
    # "#" is the tool's parameters, not the array of calls around them
    ('[{"name":"tree","parameters":{"kids":[[{"name":"tree","parameters":{"v":2}}]],"v":1}}]',
     False),
])
def test_each_tools_references_resolve_in_its_own_schema(compiler, checkpoint, text: str,
                                                         ok: bool) -> None:
    assert _accepts(compiler, checkpoint.tokenizer, text) is ok


# `properties` without `"type": "object"` (a common way to write parameters): in JSON Schema
# that constrains objects only, and lets any other value through.
UNTYPED = {"properties": {"city": {"type": "string"}}, "required": ["city"]}


def _accepts_as_arguments(compiler: GrammarCompiler, tokenizer, tool_choice: object,
                          text: str) -> bool:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tool_choice=tool_choice,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": UNTYPED}}])
    return _accepts(compiler, tokenizer, text, req)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("tool_choice", "text", "ok"), [
    (NAMED, '{"city":"Paris"}', True),
    # before: the smollm2 server answered "Weather Paris" with arguments '"SmolLM"', "hi"
    # with 'null'
    (NAMED, '"SmolLM"', False),
    (NAMED, "null", False),
    (NAMED, '["Paris"]', False),
    ("required", '[{"name":"get_weather","parameters":{"city":"Paris"}}]', True),
    ("required", '[{"name":"get_weather","parameters":"Paris"}]', False),
    ("required", '[{"name":"get_weather","parameters":null}]', False),
])
def test_arguments_are_an_object_even_where_parameters_do_not_say_so(
        compiler, checkpoint, tool_choice: object, text: str, ok: bool) -> None:
    assert _accepts_as_arguments(compiler, checkpoint.tokenizer, tool_choice, text) is ok


@pytest.mark.parametrize("kind", ["string", ["object", "null"], "array"])
def test_parameters_of_another_type_are_a_400(kind: object) -> None:
    from argosy_runtime.server.errors import APIError

    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tool_choice=NAMED,
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "parameters": {"type": kind}}}])
    with pytest.raises(APIError) as info:
        tool_call_constraint(req)
    assert info.value.status == 400 and info.value.param == "tools"


DRAFT4 = "http://json-schema.org/draft-04/schema#"
# As older generators and some MCP servers write tools: draft-04 names a schema with `id`
# and ignores `$id`, which scoped each tool, so its `#/definitions/...` did not resolve in
# its own parameters ("Pointer '/definitions/X' does not exist": a 400).
DRAFT4_TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {
        "$schema": DRAFT4, "type": "object", "properties": {"x": {"$ref": "#/definitions/X"}},
        "required": ["x"], "definitions": {"X": {"type": "integer"}}}}},
    # its own draft-04 id, and a definition of the same name but another type
    {"type": "function", "function": {"name": "b", "parameters": {
        "$schema": DRAFT4.rstrip("#"), "id": "http://example.com/b.json", "type": "object",
        "properties": {"y": {"$ref": "#/definitions/X"}}, "required": ["y"],
        "definitions": {"X": {"type": "string"}}}}},
]


@pytest.mark.parametrize(("text", "ok"), [
    ('[{"name":"a","parameters":{"x":1}}]', True),
    ('[{"name":"a","parameters":{"x":"s"}}]', False),
    ('[{"name":"b","parameters":{"y":"s"}}]', True),
    ('[{"name":"b","parameters":{"y":1}}]', False),
])
def test_draft04_tools_resolve_their_own_definitions(compiler, checkpoint, text: str,
                                                     ok: bool) -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                tools=DRAFT4_TOOLS, tool_choice="required")
    assert _accepts(compiler, checkpoint.tokenizer, text, req) is ok
