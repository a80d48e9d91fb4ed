"""POST /v1/responses (OpenAI's Responses API) through the official `openai` client against
the shared real server (float32, greedy): the same text as chat completions, streamed events in
OpenAI's order, stored responses, background responses (poll, cancel, replay), and 4xx
errors."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

EVENTS = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "You are a helpful assistant."
GREETING = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done"]


def chat_text(client: OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=max_tokens)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_create_equals_chat_completion(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=GREETING,
                                max_output_tokens=40, temperature=0, metadata={"k": "v"},
                                user="u1")
    text, finish = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": "Hi"}], 40)
    assert finish == "stop" and text
    assert r.output_text == text
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert [(p.type, p.text, p.annotations) for p in message.content] == \
        [("output_text", text, [])]
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.metadata, r.user, r.store, r.temperature, r.max_output_tokens) \
        == (INSTRUCTIONS, {"k": "v"}, "u1", True, 0.0, 40)


def test_wire_format_validates_against_the_client_types(http: httpx.Client) -> None:
    """Strict validation (not the client's lenient parsing) of every field we send."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "store": False}
    Response.model_validate(http.post("/v1/responses", json=body).json())
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for event in data:
        EVENTS.validate_python(event)
    assert data[-1]["type"] == "response.incomplete"


def test_max_output_tokens_makes_it_incomplete(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=3,
                                temperature=0, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 3
    text, _ = chat_text(client, [{"role": "user", "content": "Tell me a story."}], 3)
    assert r.output_text == text


def test_completed_at_only_when_completed(client: OpenAI) -> None:
    """OpenAI's `completed_at` is "only present when the status is `completed`": a response
    cut by max_output_tokens ends incomplete without one, streamed or not."""
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=40,
                                   temperature=0, store=False)
    assert done.status == "completed" and done.completed_at >= done.created_at
    cut = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert cut.status == "incomplete" and cut.completed_at is None
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                          stream=True, store=False))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.completed_at is None


@pytest.mark.parametrize("max_tokens, end", [(40, "response.completed"),
                                             (4, "response.incomplete")])
def test_stream_events_in_openai_order(client: OpenAI, max_tokens: int, end: str) -> None:
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=max_tokens,
                                    temperature=0)
    events = list(client.responses.create(model=MODEL, input="Hi", temperature=0,
                                          max_output_tokens=max_tokens, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == STREAM_EVENTS + ["response.output_text.delta"] * len(deltas) + \
        STREAM_END + [end]
    assert len(deltas) > 2  # really incremental
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_id = events[2].item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}
    assert final.output[0].id == item_id and events[0].response.id == final.id
    assert events[-4].text == whole.output_text  # response.output_text.done
    # a streamed response is stored too
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_stream_helper_parses_the_events(client: OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=40,
                                    temperature=0)
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=40,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == "completed"


def test_previous_response_id_continues_the_conversation(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions="Be brief.",
                                    input="My name is Ann.", max_output_tokens=12,
                                    temperature=0)
    follow = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="What is my name?", max_output_tokens=12,
                                     temperature=0)
    # OpenAI does not carry a previous response's instructions over
    text, _ = chat_text(client, [{"role": "user", "content": "My name is Ann."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 12)
    assert follow.output_text == text
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    third = client.responses.create(model=MODEL, previous_response_id=follow.id,
                                    input=[{"role": "user", "content": "Thanks."}],
                                    max_output_tokens=6, temperature=0)
    text, _ = chat_text(client, [{"role": "user", "content": "My name is Ann."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"},
                                 {"role": "assistant", "content": follow.output_text},
                                 {"role": "user", "content": "Thanks."}], 6)
    assert third.output_text == text


def test_retrieve_input_items_and_delete(client: OpenAI) -> None:
    created = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        max_output_tokens=5, temperature=0)
    got = client.responses.retrieve(created.id)
    assert got.model_dump(exclude={"completed_at"}) == \
        created.model_dump(exclude={"completed_at"})
    items = client.responses.input_items.list(created.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [("developer", "Be brief."),
                                                            ("user", "Hi")]
    assert client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve(created.id)
    assert exc.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=created.id)
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_store_false_is_not_kept(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_text_format_json_schema_constrains_the_output(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(
        model=MODEL, input="Is the sky blue? Answer in JSON.", max_output_tokens=30,
        temperature=0, store=False,
        text={"format": {"type": "json_schema", "name": "yes_no", "schema": schema}})
    assert r.status == "completed"
    assert json.loads(r.output_text)["answer"] in ("yes", "no")
    assert r.text.format.type == "json_schema" and r.text.format.name == "yes_no"


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, {"type": "text"},
                                 {"type": "json_object", "schema": None}])
def test_text_format_without_schema_fields_is_accepted(client: OpenAI, fmt: dict) -> None:
    # the other side of refusing json_schema-only fields: bare types (or explicit nulls) pass
    r = client.responses.create(model=MODEL, input="Say hi in JSON.", max_output_tokens=4,
                                temperature=0, store=False, text={"format": fmt})
    assert r.status in ("completed", "incomplete")
    assert r.text.format.type == fmt["type"]


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": "Hi", "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ({"input": 123}, 400, "input", "expected a string or a list of input items"),
    ({"input": ["Hi"]}, 400, "input", "input[0]: expected an input item"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, 400, "input", "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input", "input[0].content[0].type: 'input_image' is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input", "input[0].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
    ({"input": "Hi", "tools": [{"type": "function"}]}, 400, "tools", "tools[0].name"),
    ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice", "tool_choice"),
    ({"input": "Hi", "background": True, "store": False}, 400, "background", "store"),
    ({"input": "Hi", "truncation": "auto"}, 400, "truncation", "truncation"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, 400, "include", "include"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text",
     "text.format.name"),
    # json_schema-only fields with another type were accepted, the schema silently ignored
    ({"input": "Hi", "text": {"format": {"type": "json_object", "schema": {
        "type": "object"}}}}, 400, "text", "text.format.schema: only allowed with type "
     "'json_schema', not 'json_object'"),
    ({"input": "Hi", "text": {"format": {"type": "text", "name": "n"}}}, 400, "text",
     "text.format.name: only allowed with type 'json_schema', not 'text'"),
    ({"input": "Hi", "text": {"format": {"type": "json_object", "strict": True}}}, 400, "text",
     "text.format.strict"),
    ({"input": "Hi " * 3000, "max_output_tokens": 5}, 400, "input", "maximum context length"),
    # a schema llguidance cannot take (a 128-bit bound) was "text.format: Value is not JSON
    # serializable", naming no field of the schema
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "integer", "maximum": 10**30}}}}, 400, "text",
     "text.format.schema: the integer 1000000000000000000000000000000 is out of"),
    # and this one killed the server (SIGSEGV inside llguidance)
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"const": -(2**63)}}}}], "tool_choice":
      "required"}, 400, "tools", "tools: parameters: the integer -9223372036854775808"),
    # OpenAI's metadata limits (16 pairs was already checked), as on the Batch API
    ({"input": "Hi", "metadata": {"k" * 65: "v"}}, 400, "metadata", "at most 64 characters"),
    ({"input": "Hi", "metadata": {"k": "v" * 513}}, 400, "metadata", "at most 512 characters"),
    ({"input": "Hi", "model": "no-such-model"}, 404, "model", "does not exist"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id",
     "resp_unknown"),
    # reasoning items are not shown to the model: alone they leave nothing to answer (was
    # chat's "messages: List should have at least 1 item", param null)
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input", "no message to answer"),
])
def test_errors_are_4xx_naming_the_field(http: httpx.Client, body: dict, status: int,
                                         param: str, words: str) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_metadata_at_openais_limits_is_accepted(client: OpenAI) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False,
                                metadata=metadata)
    assert r.metadata == metadata


def test_null_store_and_stream_mean_their_defaults(client: OpenAI, http: httpx.Client) -> None:
    """JSON null for an optional field is its default: `store` true (a background response
    with `store: null` was a 400, and a foreground one was not stored), `stream` false."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": None,
            "stream": None}
    r = http.post("/v1/responses", json={**body, "background": True})
    assert r.status_code == 200, r.text
    assert r.json()["store"] is True and r.json()["status"] in ("queued", "in_progress")
    assert _poll(client, r.json()["id"]).status == "incomplete"
    made = http.post("/v1/responses", json=body).json()
    assert made["store"] is True and made["object"] == "response"
    assert client.responses.retrieve(made["id"]).output_text == made["output"][0]["content"][0]["text"]


def test_unknown_response_id_is_a_404(http: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        r = http.request(method, "/v1/responses/resp_unknown")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "response_not_found"
    assert http.get("/v1/responses/resp_unknown/input_items").status_code == 404
    # a bad query parameter is named as itself (was param "query")
    r = http.get("/v1/responses/resp_unknown/input_items", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    r = http.post("/v1/responses/resp_unknown/cancel")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_disconnect_mid_stream_aborts_and_frees_kv(server: ServerProcess) -> None:
    idle_running, idle_kv = server.running_and_kv()
    assert idle_running == 0
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        with h.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            deltas = 0
            while deltas < 4:
                deltas += next(lines) == "event: response.output_text.delta"
            running, kv = server.running_and_kv()
            assert running == 1 and kv > idle_kv
    server.assert_back_to_idle(idle_kv, within=1.0)
    assert "client_disconnected" in server.log_text()


def test_a_streamed_response_is_stored_from_its_start(server: ServerProcess, client: OpenAI,
                                                     http: httpx.Client) -> None:
    """The id `response.created` names is retrievable while the response
    streams (`in_progress`; it was a 404 until the end) and cannot be continued yet; one whose
    client left is forgotten."""
    body = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        events = _events(r.iter_lines())
        response_id = next(events)["response"]["id"]
        assert client.responses.retrieve(response_id).status == "in_progress"
        follow = http.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                  "previous_response_id": response_id})
        assert follow.status_code == 400 and "in_progress" in follow.json()["error"]["message"]
        last = list(events)[-1]
    assert last["type"] == "response.incomplete"
    assert http.get(f"/v1/responses/{response_id}").json() == last["response"]

    with httpx.Client(base_url=server.url, timeout=60) as h, \
            h.stream("POST", "/v1/responses", json={**body, "max_output_tokens": 1500}) as r:
        left = next(_events(r.iter_lines()))["response"]["id"]
    deadline = time.monotonic() + 10
    while http.get(f"/v1/responses/{left}").status_code != 404:
        assert time.monotonic() < deadline, "a response whose client left is still stored"
        time.sleep(0.05)


def test_a_failed_streamed_response_is_stored_as_failed() -> None:
    """A response past --request-timeout ends `failed`, and is retrievable as such (it was
    never stored), though not continued: there is no answer to continue from."""
    server = ServerProcess("--request-timeout", "1").wait_ready()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as h:
            with h.stream("POST", "/v1/responses", json={
                    "model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 1500,
                    "ignore_eos": True, "stream": True}) as r:
                last = list(_events(r.iter_lines()))[-1]
            assert last["type"] == "response.failed"
            stored = h.get(f"/v1/responses/{last['response']['id']}")
            assert stored.status_code == 200 and stored.json() == last["response"]
            follow = h.post("/v1/responses", json={
                "model": MODEL, "input": "Hi", "previous_response_id": last["response"]["id"]})
            assert follow.status_code == 400 and "failed" in follow.json()["error"]["message"]
    finally:
        server.stop()


def _poll(client: OpenAI, response_id: str, timeout: float = 60.0) -> Response:
    """The background response once it left queued/in_progress."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_background_response_polls_to_the_foreground_text(client: OpenAI) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 20, "temperature": 0}
    created = client.responses.create(**body, background=True)
    assert created.status in ("queued", "in_progress") and created.background is True
    assert created.output == [] and created.store is True
    done = _poll(client, created.id)
    whole = client.responses.create(**body)
    assert (done.status, done.output_text) == (whole.status, whole.output_text)
    assert done.usage.output_tokens == whole.usage.output_tokens and done.background is True
    assert client.responses.cancel(created.id).status == whole.status  # finished: unchanged


def test_cancel_a_background_response_frees_its_kv(server: ServerProcess, client: OpenAI,
                                                   http: httpx.Client) -> None:
    idle_running, idle_kv = server.running_and_kv()
    assert idle_running == 0
    created = client.responses.create(model=MODEL, input="Tell me a long story.",
                                      max_output_tokens=1500, background=True,
                                      extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 30
    while server.running_and_kv()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.running_and_kv()[0] == 1
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                         "previous_response_id": created.id})
    assert r.status_code == 400 and "in_progress" in r.json()["error"]["message"]
    cancelled = client.responses.cancel(created.id)
    assert cancelled.id == created.id and cancelled.status == "cancelled"
    server.assert_back_to_idle(idle_kv, within=1.0)
    assert client.responses.retrieve(created.id).status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # idempotent
    assert f"background response {created.id} cancelled" in server.log_text()


def _events(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[6:])


def test_background_stream_outlives_its_client_and_replays(client: OpenAI,
                                                           http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 40,
            "temperature": 0, "ignore_eos": True, "background": True, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        seen = []
        for event in _events(r.iter_lines()):
            seen.append(event)
            if sum(e["type"] == "response.output_text.delta" for e in seen) == 3:
                break  # and leave: the response goes on
    response_id = seen[0]["response"]["id"]
    assert seen[0]["response"]["status"] == "queued"
    done = _poll(client, response_id)
    assert done.status == "incomplete" and done.usage.output_tokens == 40
    last = seen[-1]["sequence_number"]
    replayed = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [e.sequence_number for e in replayed] == \
        list(range(last + 1, last + 1 + len(replayed)))
    assert replayed[-1].type == "response.incomplete"
    assert replayed[-1].response.output_text == done.output_text
    # the whole stream again, from the start, strictly valid
    with http.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        everything = list(_events(r.iter_lines()))
    for event in everything:
        EVENTS.validate_python(event)
    assert everything[:len(seen)] == seen
    assert [e["sequence_number"] for e in everything] == list(range(len(everything)))
    deltas = [e["delta"] for e in everything if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == done.output_text


def test_only_background_responses_stream_on_retrieve_or_cancel(client: OpenAI,
                                                                http: httpx.Client) -> None:
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for r in (http.get(f"/v1/responses/{made.id}", params={"stream": "true"}),
              http.post(f"/v1/responses/{made.id}/cancel")):
        assert r.status_code == 400, r.text
        assert "background" in r.json()["error"]["message"]
    assert http.get(f"/v1/responses/{made.id}").json()["status"] == made.status


def test_a_drain_cuts_a_background_response_short_as_failed() -> None:
    """SIGTERM with a background response still running past --drain-timeout: its followers
    get `response.failed` (server_error) and the server exits 0, no task left pending."""
    server = ServerProcess("--drain-timeout", "1").wait_ready()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as h:
            made = h.post("/v1/responses", json={
                "model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 1500,
                "ignore_eos": True, "background": True}).json()
            with h.stream("GET", f"/v1/responses/{made['id']}",
                          params={"stream": "true"}) as r:
                events = _events(r.iter_lines())
                while next(events)["type"] != "response.output_text.delta":
                    pass
                server.proc.send_signal(signal.SIGTERM)
                last = list(events)[-1]
        EVENTS.validate_python(last)
        assert last["type"] == "response.failed"
        assert last["response"]["error"]["code"] == "server_error"
        assert last["response"]["output"][0]["status"] == "incomplete"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    log = server.log_text()
    assert "drain timeout: aborting 1 request(s)" in log
    assert "Traceback" not in log and "destroyed" not in log
