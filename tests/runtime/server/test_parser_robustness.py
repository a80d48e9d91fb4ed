"""Tool-call and reasoning parsers on hostile or odd model output: whatever a model writes,
parsing never raises, never loses text, returns nothing a response cannot carry (JSON in
UTF-8), and a streamed reply (any chunking) adds up to the non-streamed message."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from argosy_runtime.server.protocol import ChatCompletionRequest
from argosy_runtime.server.reasoning_parser import ReasoningStream, split_reasoning
from argosy_runtime.server.tool_calls import reply_message
from argosy_runtime.server.tool_parsers import make_stream, parse_message

DEEP = 5000  # nesting far past Python's recursion limit (a model stuck repeating "[")

HOSTILE = {  # texts that must come back whole as content: no well-formed call in them
    "hermes": {
        "deep array": "<tool_call>" + "[" * DEEP + "</tool_call>",
        "deep arguments": '<tool_call>{"name": "f", "arguments": ' + '{"a": ' * DEEP
                          + "1" + "}" * DEEP + "}</tool_call>",
        "lone surrogate in the name": '<tool_call>{"name": "f\\ud800"}</tool_call>',
        "lone surrogate in the arguments": ('<tool_call>{"name": "f", "arguments": '
                                            '{"a": "\\udc00"}}</tool_call>'),
        "lone surrogate in string arguments": ('<tool_call>{"name": "f", "arguments": '
                                               '"\\udead"}</tool_call>'),
        "NaN": '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
        "overflowing number": '<tool_call>{"name": "f", "arguments": {"a": 1e999}}</tool_call>',
    },
    "llama3_json": {
        "deep arguments": '{"name": "f", "parameters": ' + '{"a": ' * DEEP + "1"
                          + "}" * DEEP + "}",
        "lone surrogate": '{"name": "f", "parameters": {"a": "x\\ud800"}}',
        "Infinity": '{"name": "f", "parameters": {"a": -Infinity}}',
    },
    "mistral": {
        "deep list": "[TOOL_CALLS]" + "[" * DEEP,
        "deep arguments": "[TOOL_CALLS]f[ARGS]" + '{"a": ' * DEEP + "1" + "}" * DEEP,
        "lone surrogate in a list": '[TOOL_CALLS][{"name": "f", "arguments": {"a": "\\ud800"}}]',
        "lone surrogate after [ARGS]": '[TOOL_CALLS]f[ARGS]{"a": "\\udfff"}',
        "NaN after [ARGS]": '[TOOL_CALLS]f[ARGS]{"a": NaN}',
    },
    "pythonic": {
        "lone surrogate": '[f(a="\\ud800")]',
        "deep list": "[f(a=" + "[" * DEEP + "]" * DEEP + ")]",
    },
}
HOSTILE_CASES = [(p, name, text) for p, texts in HOSTILE.items() for name, text in texts.items()]


def streamed(parser: str, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """(content, calls) from feeding `text` split at `cuts`, then finishing."""
    stream = make_stream(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return ("".join(d.get("content", "") for d in deltas),
            [c for d in deltas for c in d.get("tool_calls", [])])


def sendable(body: object) -> bytes:
    """`body` as the server sends it (JSON, non-ASCII as is, UTF-8): raises if it cannot be."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False).encode()


@pytest.mark.parametrize(("parser", "name", "text"), HOSTILE_CASES,
                         ids=[f"{p}-{n}" for p, n, _ in HOSTILE_CASES])
def test_hostile_text_is_content_not_an_error(parser: str, name: str, text: str) -> None:
    """Before: deep nesting raised RecursionError (a 500); a lone surrogate escape gave a call
    that UTF-8 cannot encode (a 500 when the response is written); NaN and infinities, which
    Python's json reads but JSON has not, gave arguments no JSON parser reads."""
    message, finish = parse_message(parser, text, "stop")
    assert (message, finish) == ({"role": "assistant", "content": text}, "stop")
    sendable(message)
    cuts = [len(text) // 3, len(text) // 2, len(text) - 1]
    assert streamed(parser, text, cuts) == (text, [])


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud83d\\ude00 \\u00e9"}}'
               "</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": "\\ud83d\\ude00 \\u00e9"}}'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "\\ud83d\\ude00 \\u00e9"}'),
    ("pythonic", '[f(a="\\ud83d\\ude00 \\u00e9")]'),
])
def test_a_paired_surrogate_escape_is_a_character(parser: str, text: str) -> None:
    """A surrogate pair written as escapes is one character (here an emoji): still a call."""
    if parser == "pythonic":  # Python reads the pair as two code points, not one character
        text = text.replace("\\ud83d\\ude00", "\\U0001f600")
    message, _ = parse_message(parser, text, "stop")
    [call] = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": "\U0001f600 é"}
    sendable(message)


@pytest.mark.parametrize("text", [
    '<|python_tag|> {"name": "f", "parameters": {"a": 1}}',
    '\n<|python_tag|>\n{"name": "f", "parameters": {"a": 1}}',
])
def test_llama3_json_call_after_the_python_tag_and_a_space(text: str) -> None:
    """Before: the stream took the text after `<|python_tag|>` and blanks as JSON (held it
    back), but then read it from the blank and found no call: the reply came back as text."""
    message, finish = parse_message("llama3_json", text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("f", {"a": 1})]


def _required_request(tool_choice: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tool_choice=tool_choice,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_required_call_with_a_lone_surrogate_escape_is_sendable() -> None:
    """tool_choice "required": the constrained output is JSON, whose strings may hold any
    `\\uXXXX` escape. Before: a lone surrogate went into the arguments raw, and writing the
    response failed (a 500). Kept escaped, the arguments still read back the same."""
    text = '[{"name": "f", "parameters": {"a": "x\\udead"}}]'
    message, finish = reply_message(_required_request("required"), text, "stop")
    assert finish == "tool_calls"
    [call] = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": "x\udead"}
    sendable(message)


def test_constrained_output_nested_too_deep_is_content() -> None:
    """A tool with no parameters schema takes any object, so nesting is unbounded. Before:
    RecursionError (a 500); now the text comes back as content, as any output not read."""
    text = '[{"name": "f", "parameters": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}]"
    assert reply_message(_required_request("required"), text, "stop") == (
        {"role": "assistant", "content": text}, "stop")


# Odd but well-formed replies, and their parse: every chunking streams the same.
ODD = {
    "hermes": [
        'Hi <tool_call>{"name": "f", "arguments": {"q": "a \\"</tool_call>\\" b"}}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"name": "g", "arguments": "{}"}'
        "</tool_call>\n\nDone.",
        "</tool_call> <tool_call><tool_call>{}</tool_call> <tool_cal",
        '<tool_call>{"name": "é"}</tool_call> <tool_call>{"name": "f"',
        "",
    ],
    "llama3_json": ['<|python_tag|> {"name": "f"} ; {"name": "g", "parameters": {}} ;',
                    " <|python_tag|>print(1)", "<|python_", "{", ""],
    "mistral": ['x[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS][{"name": "g"}]', "[TOOL_CALLS",
                '[[TOOL_CALLS]f{"a": "[TOOL_CALLS]"}', "[TOOL_CALLS]", ""],
    "pythonic": ['  [f(a="])"), g()]\n', "[", "[f()] [g()]", ""],
}
ODD_CASES = [(p, text) for p, texts in ODD.items() for text in texts]


def cuttings(text: str) -> list[list[int]]:
    """Every way to cut `text` once or twice, and into single characters."""
    inner = range(1, len(text))
    return [[]] + [[i] for i in inner] + [list(c) for c in itertools.combinations(inner, 2)] \
        + [list(inner)]


def _names_args(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(("parser", "text"), ODD_CASES)
def test_every_chunking_streams_the_message(parser: str, text: str) -> None:
    message, _ = parse_message(parser, text, "stop")
    want_calls = _names_args(message.get("tool_calls") or [])
    for cuts in cuttings(text):
        content, calls = streamed(parser, text, cuts)
        assert _names_args(calls) == want_calls, cuts
        assert [c["index"] for c in calls] == list(range(len(calls)))
        if want_calls:
            assert (content.strip() or None) == message["content"], cuts
        else:
            assert content == text, cuts  # nothing the model wrote is lost


REASONING_ODD = [
    '<think>a</think>\n<tool_call>{"name": "f"}</tool_call>',
    '</think><tool_call>{"name": "f"}</tool_call>',  # no opening tag
    "<think><think>x</think>y</think>z",  # nested: the first </think> ends the thinking
    "<think>never ends <tool_call>",  # cut off by max_tokens while thinking
    " <think>\n</think>\n\n",  # an empty thought and no answer
    "",
]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", REASONING_ODD)
def test_reasoning_then_tool_calls_stream_as_the_whole(parser: str, text: str) -> None:
    """As serving_chat chains them: the reasoning stream's answer deltas feed the tool-call
    stream; at any chunking the parts add up to the non-streamed split and parse."""
    reasoning, answer = split_reasoning(parser, text)
    message, finish = parse_message("hermes", answer, "stop")
    for cuts in cuttings(text):
        thinking, calls_stream = ReasoningStream(parser), make_stream("hermes")
        got_reasoning, content, calls, got_finish = "", "", [], None
        bounds = [0, *cuts, len(text)]
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            last = i == len(bounds) - 2
            r, piece = thinking.feed(text[a:b], last)
            delta, got_finish = calls_stream.step(piece, "stop" if last else None)
            got_reasoning += r
            content += delta.get("content", "")
            calls += delta.get("tool_calls", [])
        assert got_reasoning == (reasoning or ""), cuts
        assert _names_args(calls) == _names_args(message.get("tool_calls") or []), cuts
        if calls:
            assert (content.strip() or None) == message["content"], cuts
        else:
            assert content == answer, cuts  # nothing the model wrote is lost
        assert got_finish == finish


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_long_thought_streams_in_linear_time(parser: str) -> None:
    """A reasoning model may think for tens of thousands of tokens (until max_tokens). Before,
    each token's delta re-split the whole reply so far: 40,000 tokens took ~5 s of the event
    loop, which every other stream on the server waits on (quadratic). Each delta now looks at
    the new text plus what the stream holds back, and that stays bounded (a partial tag or a
    few blanks), so the work is linear in the reply (measured ~0.05 s for the same run)."""
    stream, pieces = ReasoningStream(parser), ["<think>\n", *[" word"] * 20_000, "</think>",
                                               *[" answer"] * 20_000]
    out, most_held = [], 0
    for piece in pieces:
        out.append(stream.feed(piece, finished=False))
        most_held = max(most_held, len(stream.held))
    out.append(stream.feed("", finished=True))
    assert "".join(r for r, _ in out) == ("word " * 20_000).strip()
    assert "".join(a for _, a in out) == ("answer " * 20_000).strip()
    assert most_held <= len("</think>")


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime


@pytest.mark.slow  # starts `argosy serve`
def test_a_lone_surrogate_escape_through_the_server(tmp_path: Path) -> None:
    """A pythonic reply whose string holds an unpaired `\\udead` escape: before, a 500 (and
    a broken stream); now the reply is content, whole and streamed, through the openai client."""
    from model_factory import make_scripted_model_dir
    from openai import OpenAI
    from serve_harness import ServerProcess

    text = '[weather(city="\\udead")]'
    # its tokens in SmolLM2's vocabulary, after the "\n" (198) ending the generation prompt
    folder = make_scripted_model_dir(tmp_path, 198, [75, 29624, 24, 20721, 2671, 76, 413,
                                                     1337, 41598])
    proc = ServerProcess("--model", str(folder), "--served-model-name", "caller",
                         "--tool-call-parser", "pythonic")
    try:
        client = OpenAI(base_url=proc.wait_ready().url + "/v1", api_key="unused",
                        max_retries=0, timeout=60)
        kw = dict(model="caller", messages=[{"role": "user", "content": "Weather?"}],
                  tools=[{"type": "function", "function": {"name": "weather", "parameters": {
                      "type": "object", "properties": {"city": {"type": "string"}}}}}],
                  temperature=0, max_tokens=20)
        choice = client.chat.completions.create(**kw).choices[0]
        assert (choice.message.content, choice.message.tool_calls) == (text, None)
        assert choice.finish_reason == "stop"
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    finally:
        proc.stop()
