"""tool_choice "required" with a draft-04 tool schema (`"$schema": ".../draft-04/schema#"`,
as older generators and some MCP servers write them): its `#/definitions/...` references
resolve in its own parameters, as with a named tool_choice. Before, the `$id` that scopes each
tool was ignored under draft-04 (whose keyword is `id`) and the request was a 400 ("Pointer
'/definitions/X' does not exist")."""

from __future__ import annotations

import pytest
from argosy_runtime.server.protocol import ChatCompletionRequest
from argosy_runtime.server.tool_calls import tool_call_constraint
from argosy_runtime.structured_output.grammar import GrammarCompiler

DRAFT4 = "http://json-schema.org/draft-04/schema#"


def _tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


TOOLS = [
    _tool("a", {"$schema": DRAFT4, "type": "object", "properties": {
        "x": {"$ref": "#/definitions/X"}}, "required": ["x"],
        "definitions": {"X": {"type": "integer"}}}),
    # its own draft-04 id, and a definition of the same name but another type
    _tool("b", {"$schema": DRAFT4.rstrip("#"), "id": "http://example.com/b.json",
                "type": "object", "properties": {"y": {"$ref": "#/definitions/X"}},
                "required": ["y"], "definitions": {"X": {"type": "string"}}}),
]


def _accepts(compiler: GrammarCompiler, tokenizer, text: str) -> bool:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                tool_choice="required")
    params = tool_call_constraint(req)
    params.disable_any_whitespace = True
    grammar = compiler.compile(params)  # was a ValueError (400)
    out: list[int] = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.allowed_tokens(out)[token]:
            return False
        out.append(token)
    return grammar.is_done(out)


@pytest.mark.parametrize(("text", "ok"), [
    ('[{"name":"a","parameters":{"x":1}}]', True),
    ('[{"name":"a","parameters":{"x":"s"}}]', False),
    ('[{"name":"b","parameters":{"y":"s"}}]', True),
    ('[{"name":"b","parameters":{"y":1}}]', False),
])
def test_draft04_tools_resolve_their_own_definitions(compiler, checkpoint, text: str,
                                                     ok: bool) -> None:
    assert _accepts(compiler, checkpoint.tokenizer, text) is ok
