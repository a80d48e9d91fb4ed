"""Tool calling (tool_choice "required" or a named function) through the official `openai`
client: the calls' arguments match the tools' schemas, streaming reassembles to the same
calls, and the client's pydantic helpers parse them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from openai import OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS,
                                      "description": "The local time in a time zone"}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def streamed_calls(chunks: list) -> dict[int, dict]:
    """Reassemble tool_calls deltas the way OpenAI clients do: by index, arguments appended."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or (delta.function.name if delta.function else None)
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    return calls


def test_named_function_is_called_with_valid_arguments(client: OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=GET_WEATHER, temperature=0,
              max_tokens=60)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's reason for a forced function
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    calls = streamed_calls(chunks)
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == call.function.arguments
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2


def test_a_named_function_cut_by_max_tokens_is_still_a_tool_call(client: OpenAI) -> None:
    """A named function's reply is its arguments, cut short or not: tool_calls streamed or
    not, as vLLM (unstreamed, the cut arguments were the message's content)."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=GET_WEATHER, temperature=0,
              max_tokens=4)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    with pytest.raises(json.JSONDecodeError):  # cut: not yet whole JSON
        json.loads(call.function.arguments)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    [streamed] = streamed_calls(chunks).values()
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments)


def test_required_calls_one_or_more_tools(client: OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=120)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls = streamed_calls(list(client.chat.completions.create(**kw, stream=True)))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    single = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_pydantic_function_tool_parses(client: OpenAI) -> None:
    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")

    r = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, temperature=0,
        max_tokens=60)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and parsed.unit in ("celsius", "fahrenheit")


def test_a_tool_call_conversation_renders(client: OpenAI) -> None:
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


# tool_choice "auto" (the shared server runs --tool-call-parser hermes). SmolLM2 is not trained
# to call tools, so a regex makes it write a Hermes call, as a tool-trained model would;
# the parser, not the regex, turns that text into tool_calls.
HERMES_CALL = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')


@pytest.mark.parametrize("tool_choice", ["auto", None], ids=["auto", "unset"])
def test_auto_tool_calls_the_model_writes_come_back_as_tool_calls(
        client: OpenAI, tool_choice: str | None) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMS)
    assert arguments["city"] in ("Paris", "Rome")

    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Checking."
    [streamed] = streamed_calls(chunks).values()
    assert (streamed["name"], json.loads(streamed["arguments"])) == ("get_weather", arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_without_a_call_is_plain_content(client: OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0,
              max_tokens=20, extra_body={"structured_outputs": {"regex": r"It is (sunny|rainy)\."}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content in ("It is sunny.", "It is rainy.")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        choice.message.content


# `properties` without `"type": "object"`: JSON Schema lets any non-object through that.
UNTYPED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}]


def test_arguments_are_an_object_where_parameters_omit_the_type(client: OpenAI) -> None:
    """Before: a named call's arguments were 'null' for "hi" and
    '1.111...' for "Name a city." (the grammar was the schema as written, which any
    non-object matches; "required" has the same fix, tested on its grammar in
    tests/runtime/structured_output/test_tool_call_schema.py)."""
    for question in ("hi", "Name a city."):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}],
            tools=UNTYPED_TOOLS, tool_choice=GET_WEATHER, temperature=0, max_tokens=40)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        [call] = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments, dict) and isinstance(arguments["city"], str), question


def test_parameters_of_another_type_are_a_400(client: OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "string"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                       tool_choice=GET_WEATHER, max_tokens=5)
    assert info.value.body["param"] == "tools" and "type 'object'" in info.value.body["message"]


def test_special_tokens_are_kept_for_the_hermes_parser_only_with_tools(
        client: OpenAI, http) -> None:  # noqa: ANN001
    """Hermes 2 Pro's <tool_call> tags are special tokens: with tools (tool_choice not
    "none"), the reply is decoded keeping special tokens so the parser sees them, as vLLM's
    hermes parser asks; without tools nothing changes. The model is made to write one (a
    logit_bias on <|im_start|>, a special token of this vocabulary) to see which it was."""
    [special] = http.post("/tokenize", json={"model": MODEL, "prompt": "<|im_start|>",
                                             "add_special_tokens": False}).json()["tokens"]
    forced = {"model": MODEL, "messages": ASK, "max_tokens": 1, "temperature": 0,
              "logit_bias": {str(special): 100}}

    def content(**extra: object) -> str | None:
        return client.chat.completions.create(**forced, **extra).choices[0].message.content

    assert content(tools=TOOLS) == "<|im_start|>"
    assert content() == "" and content(tools=TOOLS, tool_choice="none") == ""
