"""The tool-call parsers (tool_choice "auto"): calls the model wrote come out as OpenAI
tool_calls, everything else as content, however the text is split into stream deltas."""

from __future__ import annotations

import json

import pytest
from argosy_runtime.server.config import TOOL_CALL_PARSERS
from argosy_runtime.server.errors import APIError
from argosy_runtime.server.protocol import ChatCompletionRequest
from argosy_runtime.server.tool_calls import check_tool_choice, may_call_tools
from argosy_runtime.server.tool_parsers import (
    STREAMS,
    HermesToolCallStream,
    make_stream,
    parse_message,
)
from hypothesis import given, settings
from hypothesis import strategies as st

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}\n</tool_call>'
TEXTS = {
    "one call": CALL,
    "text then two calls": f"Let me check.\n{CALL}\n{TIME}\n",
    "no call": "It is sunny in Paris. <toolbox> is not a tag.",
    "not JSON": "<tool_call>get_weather(Paris)</tool_call> done",
    "cut off": 'Sure. <tool_call>\n{"name": "get_weather", "argu',
    "JSON of another shape": "<tool_call>[1, 2]</tool_call>",
}
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TEXTS = {
    "one call": LLAMA_CALL,
    "python tag and two calls": ('<|python_tag|>' + LLAMA_CALL
                                 + '; {"name": "get_time", "parameters": {"timezone": "UTC"}}'),
    "no call": "It is sunny in Paris {really}.",
    "cut off": '{"name": "get_weather", "param',
    "JSON of another shape": '{"city": "Paris"}',
    "leading spaces then text": "  <|py is not the tag",
}
CASES = [("hermes", name, text) for name, text in TEXTS.items()] + [
    ("llama3_json", name, text) for name, text in LLAMA_TEXTS.items()]


def streamed(text: str, cuts: list[int], parser: str = "hermes") -> tuple[str, list[dict]]:
    """(content, calls) from feeding `text` split at `cuts`, then finishing."""
    stream = make_stream(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return ("".join(d.get("content", "") for d in deltas),
            [c for d in deltas for c in d.get("tool_calls", [])])


def names_and_args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_whole_messages() -> None:
    message, finish = parse_message("hermes", TEXTS["text then two calls"], "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check."
    assert names_and_args(message["tool_calls"]) == [("get_weather", {"city": "Paris"}),
                                                     ("get_time", {"timezone": "Asia/Tokyo"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function"
               for c in message["tool_calls"])
    message, finish = parse_message("hermes", CALL, "stop")
    assert message["content"] is None and finish == "tool_calls"
    message, finish = parse_message("llama3_json", LLAMA_TEXTS["python tag and two calls"], "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert names_and_args(message["tool_calls"]) == [("get_weather", {"city": "Paris"}),
                                                     ("get_time", {"timezone": "UTC"})]
    # Not calls: the model's text comes back untouched, with its own finish_reason.
    for parser, texts in (("hermes", TEXTS), ("llama3_json", LLAMA_TEXTS)):
        for name in ("no call", "cut off", "JSON of another shape"):
            message, finish = parse_message(parser, texts[name], "length")
            assert message == {"role": "assistant", "content": texts[name]}, (parser, name)
            assert finish == "length"
    with pytest.raises(ValueError, match="tool_call_parser"):
        make_stream("mistral")


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_split_streams_what_the_whole_text_parses_to(case: tuple[str, str, str],
                                                         data: st.DataObject) -> None:
    parser, _, text = case
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    content, calls = streamed(text, cuts, parser)
    whole_content, whole_calls = streamed(text, [], parser)
    assert (content, names_and_args(calls)) == (whole_content, names_and_args(whole_calls))
    assert [c["index"] for c in calls] == list(range(len(calls)))
    if not calls:
        assert content == text  # nothing the model wrote is lost


def test_partial_tag_is_held_back_only_while_it_could_be_a_tag() -> None:
    stream = HermesToolCallStream()
    assert stream.feed("Hi <tool") == {"content": "Hi "}
    assert stream.feed("box>") == {"content": "<toolbox>"}
    assert stream.finish() == {}
    # llama3_json: text streams at once unless the reply starts as JSON (or the tag).
    llama = make_stream("llama3_json")
    assert llama.feed(" <|py") == {} and llama.feed("thon") == {}
    assert llama.feed(" no") == {"content": " <|python no"}
    assert llama.feed(" more") == {"content": " more"}
    llama = make_stream("llama3_json")
    assert llama.feed('{"name": "f", ') == {} and llama.feed('"parameters": {}}') == {}
    assert [c["function"]["name"] for c in llama.finish()["tool_calls"]] == ["f"]


def test_auto_needs_a_parser_and_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs = [{"role": "user", "content": "hi"}]
    auto = ChatCompletionRequest(model="m", messages=msgs, tools=tools, tool_choice="auto")
    with pytest.raises(APIError, match="--tool-call-parser"):
        check_tool_choice(auto, None)
    check_tool_choice(auto, "hermes")
    unset = ChatCompletionRequest(model="m", messages=msgs, tools=tools)
    assert may_call_tools(auto, "hermes") and may_call_tools(unset, "hermes")
    assert not may_call_tools(unset, None)
    assert not may_call_tools(ChatCompletionRequest(model="m", messages=msgs), "hermes")
    none = ChatCompletionRequest(model="m", messages=msgs, tools=tools, tool_choice="none")
    assert not may_call_tools(none, "hermes")


@pytest.mark.parametrize(("parser", "text"), [("hermes", CALL), ("llama3_json", LLAMA_CALL)])
def test_step_ends_a_stream_with_what_finish_releases(parser: str, text: str) -> None:
    """`step` is what a streamed choice calls: the end folds in `finish`, calls included
    (llama3_json sends its calls only then)."""
    stream = make_stream(parser)
    middle, _ = stream.step(text[:-1], None)
    last, finish = stream.step(text[-1], "stop")
    calls = middle.get("tool_calls", []) + last.get("tool_calls", [])
    assert names_and_args(calls) == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls" and "content" not in middle and "content" not in last


def test_every_flag_choice_has_a_stream() -> None:
    assert tuple(STREAMS) == TOOL_CALL_PARSERS
