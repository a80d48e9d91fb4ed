"""The Responses API's pieces without a server: chat chunks -> stream events (the timeout
path included), the stored-response LRU, and input items -> chat messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from argosy_runtime.server.errors import APIError
from argosy_runtime.server.responses.protocol import ResponsesRequest, input_messages
from argosy_runtime.server.responses.store import ResponseStore, StoredResponse
from argosy_runtime.server.responses.stream_events import ResponseEventStream
from openai.types.responses import ResponseStreamEvent
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


def test_timeout_event_fails_the_response_unstored() -> None:
    error = {"error": {"message": "request timed out", "type": "timeout_error",
                       "param": None, "code": "request_timeout"}}
    events, done = _translate([_delta("a"), _chunk(error), "data: [DONE]\n\n"])
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "request timed out"}
    assert done == []


def _entry(i: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{i}", "output": []}, (), ())


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


def test_conversation_appends_the_reply() -> None:
    response = {"id": "resp_1", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "Hel"}, {"type": "output_text", "text": "lo"}]}]}
    entry = StoredResponse(response, ({"role": "user", "content": "Hi"},), ())
    assert entry.conversation() == ({"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello"})


def test_input_items_become_chat_messages() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    assert input_messages([
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
           {"role": "assistant", "content": "c"}]
    with pytest.raises(APIError, match=r"input\[0\]: unknown field 'name'"):
        input_messages([{"role": "user", "content": "x", "name": "n"}])
    with pytest.raises(APIError, match="must not be an empty list"):
        input_messages([])


def test_http_metrics_label_response_routes_by_template() -> None:
    from argosy_runtime.server.metrics import route_label

    assert route_label("/v1/responses") == "/v1/responses"
    assert route_label("/v1/responses/resp_0123abcd") == "/v1/responses/{id}"
    assert route_label("/v1/responses/resp_0123abcd/input_items") == \
        "/v1/responses/{id}/input_items"
    assert route_label("/v1/responses/resp_0123abcd/other") == "other"
