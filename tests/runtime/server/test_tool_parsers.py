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
MISTRAL_LIST = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_TEXTS = {  # v0.3: one marker, a JSON list; newer tokenizers: name[ARGS]{...} per call
    "one call": MISTRAL_LIST,
    "text then two calls": ('Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": '
                            '{"city": "Paris"}}, {"name": "get_time", "arguments": '
                            '{"timezone": "UTC"}}]'),
    "args tag, two calls": ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                            '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'),
    "name then JSON": '[TOOL_CALLS]get_weather{"city": "Paris"}',
    "no call": "It is sunny in [Paris] [TOOL_CALL] [TOOL_",
    "not JSON": "[TOOL_CALLS][get_weather(Paris)]",
    "cut off": '[TOOL_CALLS][{"name": "get_weather", "argu',
    "JSON of another shape": '[TOOL_CALLS][{"city": "Paris"}]',
    "text after the list": MISTRAL_LIST + " Done.",
    "args not an object": "[TOOL_CALLS]get_weather[ARGS][1, 2]",
    "bad name": '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',
    "second list": MISTRAL_LIST + MISTRAL_LIST,
}
PYTHONIC_CALLS = '[get_weather(city="San Francisco", unit="celsius"), get_time()]'
PYTHONIC_TEXTS = {
    "one call": '[get_weather(city="Paris")]',
    "two calls": PYTHONIC_CALLS,
    "literals": "\n[f(a=-1.5, b=[1, (2, 3)], c={'k': None}, d=True, e='it\\'s')] ",
    "no call": "It is [sunny] in Paris (really).",
    # vLLM's semantics: a reply with calls is the list alone; text before it is no call.
    "text then a list": 'Let me check. [get_weather(city="Paris")]',
    "cut off": '[get_weather(city="Par',
    "not a list": 'get_weather(city="Paris")',
    "empty list": "[]",
    "a list of literals": "[1, 2]",
    "positional argument": '[get_weather("Paris")]',
    "variable argument": "[get_weather(city=paris)]",
    "expression argument": '[get_weather(city="Pa" + "ris")]',
    "method call": '[os.system(command="ls")]',
    "keyword repeated": "[f(a=1, a=2)]",
    "double star": "[f(**{'a': 1})]",
    "not JSON-able": "[f(a={1, 2}, b=1e999)]",
    "text after the list": "[f()] and more",
}
CASES = [("hermes", name, text) for name, text in TEXTS.items()] + [
    ("llama3_json", name, text) for name, text in LLAMA_TEXTS.items()] + [
    ("mistral", name, text) for name, text in MISTRAL_TEXTS.items()] + [
    ("pythonic", name, text) for name, text in PYTHONIC_TEXTS.items()]


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
        make_stream("granite")


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


@pytest.mark.parametrize(("parser", "name", "text"), CASES,
                         ids=[f"{p}-{n}" for p, n, _ in CASES])
def test_parallel_calls_off_keeps_only_the_first_call(parser: str, name: str,
                                                      text: str) -> None:
    """parallel_tool_calls false: the first call the model wrote, its content unchanged, at
    every split; the reply still finishes as "tool_calls"."""
    message, finish = parse_message(parser, text, "stop")
    single, single_finish = parse_message(parser, text, "stop", parallel_calls=False)
    assert (single["content"], single_finish) == (message["content"], finish)
    first = names_and_args(message.get("tool_calls") or [])[:1]
    assert names_and_args(single.get("tool_calls") or []) == first
    for cuts in [[]] + [[i] for i in range(1, len(text))]:
        stream = make_stream(parser, parallel_calls=False)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        deltas = [stream.step(p, None)[0] for p in pieces[:-1]]
        last, last_finish = stream.step(pieces[-1], "stop")
        calls = [c for d in [*deltas, last] for c in d.get("tool_calls", [])]
        assert names_and_args(calls) == first, (name, cuts)
        assert last_finish == finish


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


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", CALL), ("llama3_json", LLAMA_CALL), ("mistral", MISTRAL_LIST),
    ("pythonic", '[get_weather(city="Paris")]')])
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


MISTRAL_EXPECTED = {  # the texts that are calls: (content, [(name, arguments)])
    "one call": (None, [("get_weather", {"city": "Paris"})]),
    "text then two calls": ("Let me check.", [("get_weather", {"city": "Paris"}),
                                              ("get_time", {"timezone": "UTC"})]),
    "args tag, two calls": ("Sure.", [("get_weather", {"city": "Paris"}),
                                      ("get_time", {"timezone": "UTC"})]),
    "name then JSON": (None, [("get_weather", {"city": "Paris"})]),
}
PYTHONIC_EXPECTED = {
    "one call": [("get_weather", {"city": "Paris"})],
    "two calls": [("get_weather", {"city": "San Francisco", "unit": "celsius"}),
                  ("get_time", {})],
    "literals": [("f", {"a": -1.5, "b": [1, [2, 3]], "c": {"k": None}, "d": True,
                        "e": "it's"})],
}


@pytest.mark.parametrize(("parser", "texts", "expected"), [
    ("mistral", MISTRAL_TEXTS, MISTRAL_EXPECTED),
    ("pythonic", PYTHONIC_TEXTS, {k: (None, v) for k, v in PYTHONIC_EXPECTED.items()})])
def test_mistral_and_pythonic_messages(parser: str, texts: dict[str, str],
                                       expected: dict[str, tuple]) -> None:
    for name, text in texts.items():
        message, finish = parse_message(parser, text, "stop")
        if name not in expected:  # malformed or no call: the text, untouched
            assert (message, finish) == ({"role": "assistant", "content": text}, "stop"), name
            continue
        content, calls = expected[name]
        assert finish == "tool_calls" and message["content"] == content, name
        assert names_and_args(message["tool_calls"]) == calls, name
        assert all(c["type"] == "function" for c in message["tool_calls"])
        # A cut-off reply keeps its own finish_reason.
        assert parse_message(parser, text, "length")[1] == "length"


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    """Mistral's templates reject any other id when the conversation comes back (vLLM gives
    this parser's calls such ids too); the other parsers keep OpenAI's call_ ids."""
    message, _ = parse_message("mistral", MISTRAL_TEXTS["args tag, two calls"], "stop")
    ids = [c["id"] for c in message["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    message, _ = parse_message("pythonic", PYTHONIC_CALLS, "stop")
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


@pytest.mark.parametrize(("parser", "name", "text"),
                         [case for case in CASES if case[0] in ("mistral", "pythonic")],
                         ids=[f"{p}-{n}" for p, n, _ in CASES if p in ("mistral", "pythonic")])
def test_every_split_streams_what_the_whole_text_parses_to(parser: str, name: str,
                                                           text: str) -> None:
    """Cut once at every character boundary, and one character at a time: the stream gives
    the non-streamed message's calls, and its content (untrimmed)."""
    message, _ = parse_message(parser, text, "stop")
    want_calls = names_and_args(message.get("tool_calls") or [])
    splits = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for cuts in splits:
        content, calls = streamed(text, cuts, parser)
        assert names_and_args(calls) == want_calls, (name, cuts)
        assert [c["index"] for c in calls] == list(range(len(calls)))
        if want_calls:
            assert (content.strip() or None) == message["content"], (name, cuts)
        else:
            assert content == text, (name, cuts)  # nothing the model wrote is lost


def test_mistral_streams_content_before_the_marker_at_once() -> None:
    stream = make_stream("mistral")
    assert stream.feed("Let me check") == {"content": "Let me check"}
    assert stream.feed(" [TOOL") == {"content": " "}  # what may become the marker is held
    assert stream.feed("_CALLS][") == {} and stream.feed('{"name": "f"}]') == {}
    assert names_and_args(stream.finish()["tool_calls"]) == [("f", {})]
    # pythonic: a reply that does not start with "[" is content at once
    stream = make_stream("pythonic")
    assert stream.feed("  ") == {} and stream.feed("Hi [f()]") == {"content": "  Hi [f()]"}


def test_mistral_and_hermes_keep_special_tokens() -> None:
    """[TOOL_CALLS] is a control token in Mistral's vocabulary, <tool_call> in Hermes 2 Pro's:
    decoding must keep them for the parser to see them (the server sets
    skip_special_tokens=False for requests with tools under these parsers, as vLLM)."""
    assert {name for name, cls in STREAMS.items() if cls.keep_special_tokens} == \
        {"mistral", "hermes"}


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "[1, 2]"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": null}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": 5}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ["Paris"]}]'),
])
def test_arguments_that_are_not_an_object_are_no_call(parser: str, text: str) -> None:
    """Before: a string was taken as the arguments' JSON text as it was (`Paris`, which no
    JSON reader takes), and any other value became its JSON (`null`, `5`), none of which a
    client can call a function with. Now the model's text comes back as content."""
    assert parse_message(parser, text, "stop") == ({"role": "assistant", "content": text},
                                                   "stop")
    assert streamed(text, [len(text) // 2], parser) == (text, [])


def test_arguments_written_as_json_text_are_the_object() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    message, finish = parse_message("hermes", text, "stop")
    assert finish == "tool_calls" and names_and_args(message["tool_calls"]) == [
        ("f", {"city": "Paris"})]
