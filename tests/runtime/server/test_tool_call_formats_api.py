"""`--tool-call-parser mistral` and `pythonic` on a real `argosy serve`, through the official
`openai` client: with tool_choice "auto" (or unset) the calls the model writes come back as
`tool_calls`, streamed or not; with "none" the same text is plain content.

The model is a scripted checkpoint (model_factory.make_scripted_model_dir): its greedy reply to
a chat is exactly the text below, as a Mistral or Llama 3.2 model would write its calls. As in
Mistral's vocabulary, `[TOOL_CALLS]` is one control token (id 5 here, SmolLM2's `<file_sep>`
renamed), which decoding drops unless the server keeps special tokens for the parser. The
script's tokens must all differ, so the texts use spellings SmolLM2's vocabulary can write
without repeating a token (`"name":"weather"` with no space, `time (` with one): JSON and
Python read them all the same."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from openai import OpenAI
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_scripted_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes


class Script(NamedTuple):
    tokens: list[int]  # SmolLM2 ids, after the "\n" (198) that ends the generation prompt
    text: str  # what they decode to (special tokens skipped, as without a parser)
    content: str | None  # the message content besides the calls
    calls: list[tuple[str, dict]]


SCRIPTS = {
    "mistral": Script(
        [10280, 274, 30, 5, 75, 39428, 1245, 25535, 29624, 1002, 476, 24370, 1799, 9583,
         20721, 18, 25898, 38634, 23597, 31845],  # 5: [TOOL_CALLS]
        'Checking.[{"name":"weather", "arguments": {"city":"Paris"}}]',
        "Checking.", [("weather", {"city": "Paris"})]),
    "pythonic": Script(
        [75, 29624, 24, 20721, 2671, 38634, 6872, 655, 365, 9196, 45, 18, 35204, 41598],
        '[weather(city="Paris"), time (zone="UTC")]',
        None, [("weather", {"city": "Paris"}), ("time", {"zone": "UTC"})]),
}
TOOLS = [
    {"type": "function", "function": {
        "name": "weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in UTC?"}]


@pytest.fixture(scope="module", params=list(SCRIPTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    parser = request.param
    folder = make_scripted_model_dir(tmp_path_factory.mktemp(parser), 198,
                                     SCRIPTS[parser].tokens)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # control token 5 -> [TOOL_CALLS]
        path = folder / name
        path.write_text(path.read_text().replace('"<file_sep>"', '"[TOOL_CALLS]"'))
    proc = ServerProcess("--model", str(folder), "--served-model-name", "caller",
                         "--tool-call-parser", parser)
    try:
        yield parser, proc.wait_ready()
    finally:
        proc.stop()


def client_of(proc: ServerProcess) -> OpenAI:
    return OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def has_call_id(parser: str, call_id: str) -> bool:
    # Mistral's templates accept only 9 letters and digits (vLLM gives its calls such ids).
    if parser == "mistral":
        return len(call_id) == 9 and call_id.isalnum()
    return call_id.startswith("call_")


def test_the_reply_is_what_the_script_says(served: tuple[str, ServerProcess]) -> None:
    parser, proc = served
    resp = httpx.post(proc.url + "/v1/completions", timeout=60, json={
        "model": "caller", "prompt": [198], "max_tokens": 40, "temperature": 0})
    assert resp.json()["choices"][0]["text"] == SCRIPTS[parser].text


@pytest.mark.parametrize("tool_choice", ["auto", None], ids=["auto", "unset"])
def test_calls_come_back_as_tool_calls(served: tuple[str, ServerProcess],
                                       tool_choice: str | None) -> None:
    parser, proc = served
    script = SCRIPTS[parser]
    kw = dict(model="caller", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    client = client_of(proc)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == script.content
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == script.calls
    assert all(c.type == "function" and has_call_id(parser, c.id) for c in calls)

    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (script.content or "")
    streamed = streamed_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == script.calls
    assert list(streamed) == list(range(len(script.calls)))
    assert all(has_call_id(parser, c["id"]) for c in streamed.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_parallel_tool_calls_false_sends_the_first_call(
        served: tuple[str, ServerProcess]) -> None:
    """The model wrote two calls (pythonic) or one (mistral): with parallel_tool_calls false
    only the first is sent, streamed or not, as vLLM does."""
    parser, proc = served
    script = SCRIPTS[parser]
    kw = dict(model="caller", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
              parallel_tool_calls=False)
    client = client_of(proc)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == script.content
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == script.calls[:1]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = streamed_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
        script.calls[:1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def streamed_calls(chunks: list) -> dict[int, dict]:
    """The streamed tool calls, reassembled as OpenAI clients do: by index."""
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = streamed.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return streamed


def test_tool_choice_none_leaves_the_text_alone(served: tuple[str, ServerProcess]) -> None:
    parser, proc = served
    kw = dict(model="caller", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
              max_tokens=40)
    client = client_of(proc)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == SCRIPTS[parser].text
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        SCRIPTS[parser].text


@pytest.mark.parametrize("served", ["mistral"], indirect=True)
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "weather"}}], ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_named_as_the_parser_names_them(
        served: tuple[str, ServerProcess], tool_choice: str | dict, stream: bool) -> None:
    """Calls the grammar forces ("required", a named function) get the parser's ids too: a
    Mistral model's conversation sent back with `call_...` ids fails its template (9 letters
    and digits only), which they had. (The scripted model's reply under the grammar is
    whatever its masked logits give: for the pythonic script's model it never closes the
    "required" array, so this runs on the Mistral server only.)"""
    parser, proc = served
    kw = dict(model="caller", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              tool_choice=tool_choice)
    client = client_of(proc)
    if stream:
        ids = [c["id"] for c in streamed_calls(
            list(client.chat.completions.create(stream=True, **kw))).values()]
    else:
        ids = [c.id for c in client.chat.completions.create(**kw).choices[0].message.tool_calls
               or []]
    assert ids and all(has_call_id(parser, i) for i in ids), ids


@pytest.mark.parametrize("served", ["pythonic"], indirect=True)
def test_a_response_format_reply_streams_as_content_beside_tools(
        served: tuple[str, ServerProcess]) -> None:
    """response_format constrains the reply to its schema, so the model cannot write calls:
    the parser is off and a JSON array streams as it is generated (the pythonic parser held
    a reply starting with `[` back to the end, reading it as a possible list of calls)."""
    _, proc = served
    kw = dict(model="caller", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                  "type": "array", "items": {"type": "integer", "maximum": 9}}}})
    client = client_of(proc)
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.tool_calls is None and whole.content.startswith("[")
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        stream=True, **kw) if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.content and len(pieces) > 1, pieces
