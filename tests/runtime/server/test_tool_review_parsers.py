"""Review fixes in the tool-call parsers (tool_choice "auto"), each checked whole and on every
split of the text into stream deltas."""

from __future__ import annotations

import pytest
from argosy_runtime.server.tool_parsers import make_stream, parse_message


def _streamed(parser: str, text: str, cut: int) -> tuple[str, list[dict]]:
    stream = make_stream(parser)
    deltas = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
    return ("".join(d.get("content", "") for d in deltas),
            [c for d in deltas for c in d.get("tool_calls", [])])


@pytest.mark.parametrize("text", [
    '{"name": "John", "age": 30}',
    '{"name": "Paris"}',
    '<|python_tag|>{"name": "get_time"}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "Tokyo"}',
])
def test_llama3_json_without_arguments_is_an_answer_not_a_call(text: str) -> None:
    """A JSON reply is a call only with "parameters" or "arguments" (vLLM's rule): a model
    asked for data that writes {"name": "John", ...} did not call a function "John"."""
    message, finish = parse_message("llama3_json", text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    for cut in range(len(text) + 1):
        assert _streamed("llama3_json", text, cut) == (text, [])


def test_llama3_json_with_arguments_is_still_a_call() -> None:
    text = '{"name": "get_time", "arguments": {}}; {"name": "f", "parameters": {"a": 1}}'
    message, finish = parse_message("llama3_json", text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
            ] == [("get_time", "{}"), ("f", '{"a": 1}')]
