"""Function tools on POST /v1/responses through the official `openai` client against the
shared real server (float32, greedy, --tool-call-parser hermes): the calls are chat's, an
agent loop (function_call -> function_call_output -> answer) continues as chat would, streamed
calls come as OpenAI's function-call events, and bad tools are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "parameters": WEATHER_PARAMS}
TOOLS = [{"type": "function", **WEATHER, "strict": True}]  # Responses' flat shape
CHAT_TOOLS = [{"type": "function", "function": {**WEATHER, "strict": True}}]
FORCE = {"type": "function", "name": "get_weather"}
CHAT_FORCE = {"type": "function", "function": {"name": "get_weather"}}
ASK = "What is the weather in Paris?"
FORCED = {"model": MODEL, "input": ASK, "tools": TOOLS, "tool_choice": FORCE,
          "temperature": 0, "max_output_tokens": 60}


def chat_call(client: OpenAI) -> tuple[str, str]:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                       tools=CHAT_TOOLS, tool_choice=CHAT_FORCE, temperature=0,
                                       max_completion_tokens=60)
    [call] = r.choices[0].message.tool_calls
    return call.function.name, call.function.arguments


def test_forced_call_is_a_function_call_item_equal_to_chat(client: OpenAI,
                                                           http: httpx.Client) -> None:
    body = http.post("/v1/responses", json={**FORCED, "store": False}).json()
    r = Response.model_validate(body)  # strict: every field as the client's types define it
    assert r.status == "completed"
    [item] = r.output  # no message item: there is no text
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert (item.name, item.arguments) == chat_call(client)
    assert json.loads(item.arguments)["unit"] in ("celsius", "fahrenheit")
    assert [t.model_dump(exclude_none=True) for t in r.tools] == TOOLS
    assert r.tool_choice.name == "get_weather"


def test_agent_loop_continues_like_chat(client: OpenAI) -> None:
    first = client.responses.create(**FORCED)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "21 degrees, sunny"}
    # the follow-up sends only the output: the call is in the stored conversation
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS,
                                     input=[result], temperature=0, max_output_tokens=20)
    chat = client.chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, temperature=0, max_completion_tokens=20, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees, sunny"}])
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].message.content
    assert follow.output_text == chat.choices[0].message.content
    [listed] = client.responses.input_items.list(follow.id).data
    assert (listed.type, listed.call_id, listed.output) == \
        ("function_call_output", call.call_id, "21 degrees, sunny")

    # stateless: the earlier output items passed back as they came (`input += output`)
    again = client.responses.create(
        model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=20,
        input=[{"role": "user", "content": ASK}, *first.output, result])
    assert again.output_text == follow.output_text
    items = TypeAdapter(list[ResponseItem]).validate_python(
        [i.model_dump() for i in client.responses.input_items.list(again.id, order="asc").data])
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[1].id, items[1].call_id, items[1].arguments) == \
        (call.id, call.call_id, call.arguments)


def test_streamed_call_events(client: OpenAI, http: httpx.Client) -> None:
    whole = client.responses.create(**FORCED, store=False)
    with http.stream("POST", "/v1/responses", json={**FORCED, "stream": True}) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    events = [EVENTS.validate_python(e) for e in data]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert len(deltas) > 2  # the forced function's arguments stream as they are generated
    assert "".join(deltas) == events[-3].arguments == whole.output[0].arguments
    added, done = events[2].item, events[-2].item
    assert (added.type, added.status, added.arguments, added.name) == \
        ("function_call", "in_progress", "", "get_weather")
    assert (done.status, done.id, done.call_id) == ("completed", added.id, added.call_id)
    assert events[-1].response.output[0].arguments == whole.output[0].arguments

    with client.responses.stream(**FORCED, store=False) as stream:
        parsed = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in parsed
    [item] = final.output
    assert (item.type, item.name, item.arguments) == \
        ("function_call", "get_weather", whole.output[0].arguments)


def test_a_forced_call_cut_short_is_an_incomplete_function_call(client: OpenAI) -> None:
    """Cut by max_output_tokens, a forced call is the same incomplete `function_call` item
    streamed or not (unstreamed, it was a `message` holding the cut arguments)."""
    cut = {**FORCED, "max_output_tokens": 4, "store": False}
    whole = client.responses.create(**cut)
    assert whole.status == "incomplete"
    [item] = whole.output
    assert (item.type, item.status, item.name) == ("function_call", "incomplete", "get_weather")
    last = list(client.responses.create(**cut, stream=True))[-1]
    assert last.type == "response.incomplete"
    [streamed] = last.response.output
    assert (streamed.type, streamed.status, streamed.name, streamed.arguments) == \
        ("function_call", "incomplete", "get_weather", item.arguments)


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools",
     "tools[0].type: 'file_search' is a built-in OpenAI tool"),
    ({"tools": [{"type": "hologram"}]}, "tools", "tools[0].type: 'hologram'"),
    ({"tools": [{"type": "function", "parameters": WEATHER_PARAMS}]}, "tools",
     "tools[0].name: required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "'nope' is not one of the function tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice requires tools"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input", "input[0].call_id: no function call with call_id 'call_x'"),
])
def test_bad_tools_are_400s_naming_the_field(http: httpx.Client, body: dict, param: str,
                                             words: str) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
