"""The Responses API's pieces without a server: chat chunks -> stream events (the timeout
path and tool calls included), the stored-response LRU, input items -> chat messages,
function tools -> chat tools, and background runs (replay, cancel, shutdown)."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator

import pytest
from argosy_runtime.server.errors import APIError
from argosy_runtime.server.responses.background import BackgroundRun, BackgroundRuns
from argosy_runtime.server.responses.input_items import parse_input
from argosy_runtime.server.responses.protocol import ResponsesRequest
from argosy_runtime.server.responses.response_object import response_object
from argosy_runtime.server.responses.store import ResponseStore, StoredResponse
from argosy_runtime.server.responses.stream_events import ResponseEventStream
from argosy_runtime.server.responses.tools import chat_tool_choice, chat_tools, function_tools
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

EVENTS = TypeAdapter(ResponseStreamEvent)


def _chunk(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _delta(text: str | None, finish: str | None = None) -> str:
    delta = {} if text is None else {"content": text}
    return _chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                   "usage": None})


async def _chunks(items: list[str]) -> AsyncIterator[str]:
    for item in items:
        yield item


def _translate(items: list[str]) -> tuple[list[dict], list[dict]]:
    done: list[dict] = []
    stream = ResponseEventStream(ResponsesRequest(input="Hi"), "resp_1", 1, "m", done.append)

    async def run() -> list[str]:
        return [e async for e in stream.translate(_chunks(items))]

    raw = asyncio.run(run())
    events = []
    for text in raw:
        head, data = text.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and text.endswith("\n\n")
        EVENTS.validate_python(event)  # the official client's own types accept it
        events.append(event)
    return events, done


def test_chat_chunks_become_events_in_order() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    events, done = _translate([_delta(""), _delta("Hel"), _delta(None), _delta("lo", "stop"),
                               _chunk({"choices": [], "usage": usage}), "data: [DONE]\n\n"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(10))
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Hel", "lo"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 2
    assert done == [final]


def test_length_finish_is_incomplete() -> None:
    events, done = _translate([_delta("a", "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    assert len(done) == 1


def test_timeout_event_fails_the_response() -> None:
    error = {"error": {"message": "request timed out", "type": "timeout_error",
                       "param": None, "code": "request_timeout"}}
    events, done = _translate([_delta("a"), _chunk(error), "data: [DONE]\n\n"])
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "request timed out"}
    assert done == [events[-1]["response"]]  # the caller stores it or not (background: yes)


def test_a_grammar_failing_mid_stream_is_named_in_responses_terms() -> None:
    """A `text.format` schema failing mid-generation comes as chat's error event, worded in
    chat's fields (`response_format`, `json_schema.schema`): the failed response names the
    field this client wrote, as the unstreamed 400 does (`serving.in_responses_terms`)."""
    error = {"error": {"message": "response_format: the grammar failed after 1 generated "
                                  "token(s) (lexer error: too many expressions constructed)",
                       "type": "invalid_request_error", "param": "response_format",
                       "code": None}}
    events, _ = _translate([_delta("["), _chunk(error), "data: [DONE]\n\n"])
    final = events[-1]["response"]
    assert final["status"] == "failed", final
    assert final["error"]["message"].startswith("text.format: the grammar failed after 1 "), final
    error["error"]["message"] = "response_format: json_schema.schema: bad"
    events, _ = _translate([_chunk(error)])
    assert events[-1]["response"]["error"]["message"] == "text.format.schema: bad"


def test_an_aborted_answer_fails_the_response() -> None:
    # The server drained (SIGTERM) or aborted the request: chat's finish_reason "abort".
    events, _ = _translate([_delta("a"), _delta(None, "abort"), "data: [DONE]\n\n"])
    assert events[-1]["type"] == "response.failed"
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert "shutting down" in final["error"]["message"]
    assert final["output"][0]["status"] == "incomplete"  # items are never "failed"
    assert Response.model_validate(final).error.code == "server_error"


def _thinking(text: str, finish: str | None = None) -> str:
    return _chunk({"choices": [{"index": 0, "delta": {"reasoning_content": text},
                                "finish_reason": finish}], "usage": None})


def test_reasoning_deltas_become_a_reasoning_item_before_the_message() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "completion_tokens_details": {"reasoning_tokens": 3}}
    events, done = _translate([_delta(""), _thinking("let me"), _thinking(" see"),
                               _delta("The"), _delta(" answer", "stop"),
                               _chunk({"choices": [], "usage": usage}), "data: [DONE]\n\n"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[2]["item"]["type"] == "reasoning" and events[2]["output_index"] == 0
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[6]["text"] == "let me see" and events[9]["output_index"] == 1
    final = Response.model_validate(events[-1]["response"])
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.id == events[2]["item"]["id"] == events[4]["item_id"]
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "let me see")]
    assert reasoning.summary == [] and reasoning.status == "completed"
    assert final.output_text == "The answer"  # the thinking is not the answer
    assert final.usage.output_tokens_details.reasoning_tokens == 3
    assert done == [events[-1]["response"]]


def test_a_reply_cut_off_while_thinking_has_an_incomplete_reasoning_item_only() -> None:
    events, _ = _translate([_thinking("hmm"), _thinking(" so", "length")])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert [(i["type"], i["status"]) for i in final["output"]] == [("reasoning", "incomplete")]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm so"}]


def _entry(i: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{i}", "output": []}, (), ())


def test_text_verbosity_is_accepted_and_echoed() -> None:
    """OpenAI's `text.verbosity` (GPT-5 clients send it; vLLM takes it) was an "unknown
    field" 400: it is accepted and echoed without effect, as `reasoning.effort` is."""
    from pydantic import ValidationError

    req = ResponsesRequest(input="Hi", text={"verbosity": "low"})
    made = response_object(req, response_id="resp_1", created_at=1, model="m",
                           status="completed", output=[])
    assert Response.model_validate(made).text.verbosity == "low"
    assert made["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    unset = response_object(ResponsesRequest(input="Hi"), response_id="resp_2", created_at=1,
                            model="m", status="completed", output=[])
    assert unset["text"] == {"format": {"type": "text"}}
    with pytest.raises(ValidationError):  # OpenAI's three values only
        ResponsesRequest(input="Hi", text={"verbosity": "loud"})


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(max_entries=2)
    store.put(_entry(1))
    store.put(_entry(2))
    store.get("resp_1")  # used: resp_2 is now the oldest
    store.put(_entry(3))
    assert len(store) == 2
    assert store.get("resp_1") and store.get("resp_3")
    with pytest.raises(APIError) as exc:
        store.get("resp_2", "previous_response_id")
    assert exc.value.status == 404 and exc.value.param == "previous_response_id"
    store.delete("resp_1")
    with pytest.raises(APIError):
        store.get("resp_1")
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)


def test_store_is_bounded_in_bytes_too() -> None:
    """Long inputs, and background runs' events, count: past `max_bytes` the least recently
    used go first (10,000 entries alone could hold gigabytes). The newest entry stays even
    when it alone is over the budget, and a run's events are counted once it has ended."""

    def big(i: int, chars: int) -> StoredResponse:
        return StoredResponse({"id": f"resp_{i}", "output": []}, (),
                              ({"role": "user", "content": "x" * chars},))

    store = ResponseStore(max_bytes=25_000)
    for i in range(3):
        store.put(big(i, 10_000))
    assert [rid for rid in ("resp_0", "resp_1", "resp_2") if rid in store._entries] == \
        ["resp_1", "resp_2"]
    assert 20_000 < store.nbytes <= 25_000
    store.put(big(3, 30_000))  # alone over the budget: kept, every other entry goes
    assert len(store) == 1 and store.get("resp_3")
    store.delete("resp_3")
    assert store.nbytes == 0
    running = big(4, 100)
    running.run = types.SimpleNamespace(finished=False, events=[])
    store.put(running)
    store.put(big(5, 100))
    running.run.events.extend(["e" * 1_000] * 30)  # 30 kB of events as it ran
    running.run.finished = True
    store.put(big(6, 100))  # measured again now that it ended: over budget, the oldest goes
    assert "resp_4" not in store._entries and store.nbytes < 25_000
    assert store.get("resp_5") and store.get("resp_6")


def test_store_replace_leaves_a_deleted_response_gone() -> None:
    """A streamed response's end replaces its in_progress entry, or a client that left
    forgets it; a DELETE while it streamed stays final (it does not come back at the end)."""
    store = ResponseStore()
    started, done = _entry(1), _entry(1)
    store.put(started)
    store.replace(started, done)
    assert store.get("resp_1") is done
    store.replace(started, None)  # no longer the stored one: nothing happens
    assert store.get("resp_1") is done
    store.replace(done, None)
    assert len(store) == 0
    store.put(started)
    store.delete("resp_1")
    store.replace(started, done)
    assert len(store) == 0


def test_store_answers_another_owners_response_as_unknown() -> None:
    """A request naming an owner (a gateway tenant's) reaches only that owner's responses
    and those stored without one; a request naming none reaches all."""
    store = ResponseStore()
    mine, unowned = _entry(1), _entry(2)
    mine.owner = "a"
    store.put(mine)
    store.put(unowned)
    assert store.get("resp_1", owner="a") is mine and store.get("resp_1") is mine
    assert store.get("resp_2", owner="b") is unowned
    with pytest.raises(APIError) as other:
        store.get("resp_1", "previous_response_id", owner="b")
    with pytest.raises(APIError) as unknown:
        store.get("resp_9", "previous_response_id", owner="b")
    assert (other.value.status, other.value.code, other.value.param) == \
        (unknown.value.status, unknown.value.code, unknown.value.param) == \
        (404, "previous_response_not_found", "previous_response_id")


def test_store_never_evicts_a_running_background_response() -> None:
    store = ResponseStore(max_entries=2)
    running = _entry(1)
    running.run = types.SimpleNamespace(finished=False, events=[])
    store.put(running)
    store.put(_entry(2))
    store.put(_entry(3))  # the oldest, resp_1, still runs: resp_2 goes instead
    assert store.get("resp_1") is running and store.get("resp_3")
    with pytest.raises(APIError):
        store.get("resp_2")
    running.run.finished = True
    store.put(_entry(4))  # resp_3 was used after resp_1, so resp_1 is the oldest now
    with pytest.raises(APIError):
        store.get("resp_1")
    assert len(store) == 2


def test_conversation_appends_the_reply() -> None:
    response = {"id": "resp_1", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "Hel"}, {"type": "output_text", "text": "lo"}]}]}
    entry = StoredResponse(response, ({"role": "user", "content": "Hi"},), ())
    assert entry.conversation() == ({"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello"})


def input_messages(value: object) -> list[dict]:
    return parse_input(value).messages


def test_input_items_become_chat_messages() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    assert input_messages([
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
           {"role": "assistant", "content": "c"}]  # parts joined as chat's (vLLM's "\n")
    with pytest.raises(APIError, match=r"input\[0\]: unknown field 'name'"):
        input_messages([{"role": "user", "content": "x", "name": "n"}])
    with pytest.raises(APIError, match="must not be an empty list"):
        input_messages([])


def test_reasoning_items_are_listed_but_not_shown_to_the_model() -> None:
    # A client sending a reasoning model's output back (input += response.output).
    reasoning = {"id": "rs_1", "type": "reasoning", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": "let me see"}]}
    parsed = parse_input([
        {"role": "user", "content": "What is it?"}, reasoning,
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "The answer", "annotations": []}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "user", "content": "Again?"}])
    assert parsed.messages == [
        {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": "The answer", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "Again?"}]
    items = TypeAdapter(list[ResponseItem]).validate_python(parsed.items)
    assert [i.type for i in items] == ["message", "reasoning", "message", "reasoning",
                                       "function_call", "message"]
    assert parsed.items[1] == reasoning
    assert items[3].id.startswith("rs_") and items[3].summary[0].text == "s"
    # a message sent back keeps its id (as function calls do); one without gets a new one
    assert items[2].id == "msg_1" and items[0].id.startswith("msg_") and items[0].id != "msg_1"


def test_http_metrics_label_response_routes_by_template() -> None:
    from argosy_runtime.server.metrics import route_label

    assert route_label("/v1/responses") == "/v1/responses"
    assert route_label("/v1/responses/resp_0123abcd") == "/v1/responses/{id}"
    assert route_label("/v1/responses/resp_0123abcd/input_items") == \
        "/v1/responses/{id}/input_items"
    assert route_label("/v1/responses/resp_0123abcd/cancel") == "/v1/responses/{id}/cancel"
    assert route_label("/v1/responses/resp_0123abcd/other") == "other"


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_function_call_items_become_tool_messages() -> None:
    parsed = parse_input([
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "12:00"}]},
    ])
    assert parsed.messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {
            "id": "call_2", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    items = TypeAdapter(list[ResponseItem]).validate_python(parsed.items)
    assert [i.type for i in items] == ["message", "function_call", "function_call",
                                       "function_call_output", "function_call_output"]
    assert items[1].id == "fc_1" and items[2].id.startswith("fc_")
    assert items[3].output == "21 C" and items[4].output[0].text == "12:00"
    # text then calls of one assistant turn: one chat message
    assert parse_input([{"role": "assistant", "content": "Checking."},
                        {"type": "function_call", "call_id": "c", "name": "f",
                         "arguments": "{}"}]).messages == [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


@pytest.mark.parametrize("item, words", [
    ({"type": "function_call_output", "call_id": "nope", "output": "x"},
     "input[0].call_id: no function call with call_id 'nope'"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}},
     "input[0].arguments: expected a string"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "x": 1},
     "input[0]: unknown field 'x'"),
    ({"type": "function_call_output", "call_id": "call_1", "output": 3}, "input[0].output"),
    ({"type": "item_reference", "id": "msg_1"},
     "input[0].type: input items of type 'item_reference'"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
     "input[0].encrypted_content: encrypted reasoning is not supported"),
    ({"type": "reasoning"}, "input[0].summary: expected a list of summary_text parts"),
    ({"type": "reasoning", "summary": [], "content": [{"type": "output_text", "text": "x"}]},
     'input[0].content[0]: expected {"type": "reasoning_text", "text": <string>}'),
])
def test_bad_function_items_name_the_field(item: dict, words: str) -> None:
    with pytest.raises(APIError) as exc:
        parse_input([item])
    assert exc.value.status == 400 and exc.value.param == "input"
    assert words in exc.value.message


def test_output_for_a_stored_call_continues() -> None:
    history = [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    parsed = parse_input([{"type": "function_call_output", "call_id": "call_1",
                           "output": "21 C"}], history)
    assert parsed.messages == [{"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


def test_conversation_keeps_function_calls() -> None:
    response = {"id": "resp_1", "output": [
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"}]}
    entry = StoredResponse(response, ({"role": "user", "content": "Hi"},), ())
    assert entry.conversation()[-1] == {"role": "assistant", "content": None,
                                        "tool_calls": [CALL]}


def test_function_tools_map_onto_chat_tools() -> None:
    tools = function_tools([{"type": "function", "name": "get_weather", "strict": True,
                             "parameters": {"type": "object"}}])
    assert [t.model_dump(exclude_none=True) for t in chat_tools(tools)] == [
        {"type": "function", "function": {"name": "get_weather", "strict": True,
                                          "parameters": {"type": "object"}}}]
    assert chat_tool_choice({"type": "function", "name": "get_weather"}, tools) \
        .function.name == "get_weather"
    assert chat_tool_choice("required", tools) == "required"
    assert chat_tool_choice("auto", []) is None  # no tools: nothing to choose


@pytest.mark.parametrize("tools, choice, param, words", [
    ([{"type": "web_search"}], None, "tools", "tools[0].type: 'web_search' is a built-in"),
    ([{"type": "hologram"}], None, "tools", "tools[0].type: 'hologram' is not a known"),
    ([{"type": "function"}], None, "tools", "tools[0].name: required"),
    ([{"type": "function", "name": "a b"}], None, "tools", "tools[0].name"),
    ([{"type": "function", "name": "f", "function": {}}], None, "tools",
     "tools[0]: unknown field 'function'"),
    ([], "sometimes", "tool_choice", "tool_choice: expected one of"),
    ([], {"type": "web_search"}, "tool_choice", "tool_choice.type: 'web_search'"),
    ([{"type": "function", "name": "f"}], {"type": "function", "name": "g"}, "tool_choice",
     "'g' is not one of the function tools"),
])
def test_bad_tools_name_the_field(tools: list, choice: object, param: str, words: str) -> None:
    with pytest.raises(APIError) as exc:
        chat_tool_choice(choice, function_tools(tools))
    assert exc.value.status == 400 and exc.value.param == param
    assert words in exc.value.message, exc.value.message


def _call_delta(call: dict, finish: str | None = None) -> str:
    return _chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]},
                                "finish_reason": finish}]})


def test_tool_call_deltas_become_function_call_events() -> None:
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": '}}
    events, done = _translate([
        _chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                             "finish_reason": None}]}),
        _call_delta(first), _call_delta({"index": 0, "function": {"arguments": '"Paris"}'}}),
        _call_delta({"index": 1, "id": "call_2", "type": "function",
                     "function": {"name": "get_time", "arguments": "{}"}}, "tool_calls")])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = events[2]["item"]
    assert (added["status"], added["arguments"], added["call_id"], added["name"]) == \
        ("in_progress", "", "call_1", "get_weather")
    assert events[5]["arguments"] == '{"city": "Paris"}'
    assert [e["output_index"] for e in events[2:11]] == [0] * 5 + [1] * 4
    final = events[-1]["response"]
    assert [(i["type"], i["call_id"], i["arguments"], i["status"]) for i in final["output"]] \
        == [("function_call", "call_1", '{"city": "Paris"}', "completed"),
            ("function_call", "call_2", "{}", "completed")]
    assert done == [final]


def test_text_then_a_call_are_two_items() -> None:
    events, _ = _translate([_delta("Checking."), _call_delta(
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": "{}"}}, "tool_calls")])
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Checking."
    assert [e["type"] for e in events][2:-1] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]


def test_an_empty_reply_is_one_empty_message() -> None:
    events, _ = _translate([_delta("", "stop")])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert events[2]["type"] == "response.output_item.added"


def _background_run(chunks: AsyncIterator[str]) -> tuple[BackgroundRun, BackgroundRuns,
                                                          list[str]]:
    """A background run of `chunks` (chat's SSE), started; `closed` records its cleanup."""
    req = ResponsesRequest(input="Hi", background=True)
    entry = StoredResponse(response_object(req, response_id="resp_1", created_at=1, model="m",
                                           status="queued", output=[]), (), ())
    entry.run = run = BackgroundRun(entry)
    runs, closed = BackgroundRuns(), []
    stream = ResponseEventStream(req, "resp_1", 1, "m", on_done=run.update)
    runs.start(run, stream, chunks, lambda: closed.append("closed"))
    return run, runs, closed


def test_a_background_run_keeps_its_events_for_replay() -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def chunks() -> AsyncIterator[str]:
            yield _delta("Hel")
            await release.wait()  # the client replays while it still runs
            yield _delta("lo", "stop")

        run, runs, closed = _background_run(chunks())
        assert run.entry.response["status"] == "queued" and run.entry.response["background"]
        live = run.follow()
        first = [await anext(live) for _ in range(5)]  # created ... the first delta
        assert run.entry.response["status"] == "in_progress"
        release.set()
        rest = [e async for e in live]
        assert run.finished and closed == ["closed"] and len(runs) == 0
        everything = first + rest
        assert everything == run.events
        assert [e async for e in run.follow(3)] == everything[4:]
        assert [e async for e in run.follow(len(everything))] == []
        kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in everything]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert json.loads(everything[0].split("data: ", 1)[1])["response"]["status"] == "queued"
        assert run.entry.response["status"] == "completed"
        assert run.entry.response["output"][0]["content"][0]["text"] == "Hello"
        await run.cancel()  # finished: left as it is
        assert run.entry.response["status"] == "completed"

    asyncio.run(main())


async def _forever() -> AsyncIterator[str]:
    yield _delta("a")
    await asyncio.Event().wait()
    yield _delta("never")


def test_cancelling_a_background_run_stops_it_and_its_followers() -> None:
    async def main() -> None:
        run, runs, closed = _background_run(_forever())
        live = run.follow()
        seen = [await anext(live) for _ in range(5)]
        await run.cancel()
        assert run.entry.response["status"] == "cancelled"
        assert closed == ["closed"] and run.finished and len(runs) == 0
        assert [e async for e in live] == [] and seen == run.events
        await run.cancel()  # again: the same cancelled response
        assert run.entry.response["status"] == "cancelled" and closed == ["closed"]
        Response.model_validate(run.entry.response)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["interrupt", "shutdown"])
def test_a_background_run_cut_short_fails(how: str) -> None:
    async def main() -> None:
        run, runs, closed = _background_run(_forever())
        live = run.follow()
        seen = [await anext(live) for _ in range(5)]  # ... the first delta
        if how == "interrupt":  # the drain ran out of time
            runs.interrupt()
        else:
            await runs.shutdown()
        seen += [e async for e in live]
        assert seen == run.events and closed == ["closed"] and len(runs) == 0
        last = json.loads(seen[-1].split("data: ", 1)[1])
        EVENTS.validate_python(last)
        assert last["type"] == "response.failed" and last["sequence_number"] == len(seen) - 1
        assert last["response"] == run.entry.response
        assert run.entry.response["status"] == "failed"
        assert run.entry.response["error"]["code"] == "server_error"
        assert run.entry.response["output"][0]["content"][0]["text"] == "a"

    asyncio.run(main())


def test_a_background_run_cancelled_before_it_began_still_cleans_up() -> None:
    async def main() -> None:
        run, _, closed = _background_run(_forever())
        await run.cancel()  # the task never ran a line
        assert run.entry.response["status"] == "cancelled" and closed == ["closed"]

    asyncio.run(main())


def test_a_background_run_whose_engine_fails_ends_failed() -> None:
    async def broken() -> AsyncIterator[str]:
        yield _delta("a")
        raise RuntimeError("engine loop died")

    async def main() -> None:
        run, runs, closed = _background_run(broken())
        events = [e async for e in run.follow()]
        last = json.loads(events[-1].split("data: ", 1)[1])
        assert last["type"] == "response.failed" and last["sequence_number"] == len(events) - 1
        assert "engine loop died" in run.entry.response["error"]["message"]
        assert closed == ["closed"] and len(runs) == 0

    asyncio.run(main())


def _tool_call(arguments: str, finish: str | None = None) -> str:
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": arguments}}
    return _chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]},
                                "finish_reason": finish}], "usage": None})


def test_a_whole_call_ending_a_cut_reply_is_completed_as_unstreamed() -> None:
    """A reply cut by max_output_tokens right after a parsed (or "required") call: the call
    came whole, so it is `completed` as the unstreamed response has it; it was `incomplete`
    because it was the item still open."""
    events, done = _translate([_tool_call('{"x": 1}'), _delta(None, "length")])
    assert events[-1]["type"] == "response.incomplete"
    [call] = done[0]["output"]
    assert (call["type"], call["status"], call["arguments"]) == \
        ("function_call", "completed", '{"x": 1}')
    item_done = next(e for e in events if e["type"] == "response.output_item.done")
    assert item_done["item"]["status"] == "completed"
