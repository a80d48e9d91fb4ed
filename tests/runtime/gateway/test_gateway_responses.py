"""The Responses API through `argosy fleet` (2 real replicas, round-robin, float32): stored
responses live on one replica, and every call on one (a `previous_response_id` follow-up,
GET, DELETE, a background response's cancel and event stream) reaches it, whatever the
policy would pick."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from argosy_runtime.fleet.replica_process import free_port
from test_gateway_e2e import MODEL, FleetHandle, fleet_process

pytestmark = pytest.mark.slow

SERVE_ARGS = ["--", "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--drain-timeout",
              "5", "--dtype", "float32"]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHandle]:
    args = ["--model", MODEL, "--replicas", "2", "--port", str(free_port()),
            "--policy", "round-robin", "--no-restart", *SERVE_ARGS]  # fmt: skip
    with fleet_process(args, tmp_path_factory.mktemp("fleet")) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(fleet: FleetHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _holders(fleet: FleetHandle, response_id: str) -> list[str]:
    return [url for url in fleet.replicas
            if httpx.get(f"{url}/v1/responses/{response_id}").status_code == 200]


def test_follow_ups_reach_the_replica_holding_the_response(fleet: FleetHandle,
                                                           client: openai.OpenAI) -> None:
    first = client.responses.with_raw_response.create(
        model=MODEL, input="My name is Ann.", max_output_tokens=8, temperature=0)
    backend = first.headers["x-argosy-backend"]
    first = first.parse()
    assert _holders(fleet, first.id) == [backend]  # one replica holds it
    previous = first
    history = [{"role": "user", "content": "My name is Ann."}]
    for question in ("What is my name?", "Thanks."):  # round-robin alone would alternate
        raw = client.responses.with_raw_response.create(
            model=MODEL, previous_response_id=previous.id, input=question,
            max_output_tokens=8, temperature=0)
        assert raw.headers["x-argosy-backend"] == backend
        follow = raw.parse()
        history += [{"role": "assistant", "content": previous.output_text},
                    {"role": "user", "content": question}]
        chat = client.chat.completions.create(model=MODEL, messages=history, temperature=0,
                                              max_completion_tokens=8)
        assert follow.output_text == chat.choices[0].message.content
        previous = follow
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_streamed_create_then_follow_up(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=6,
                                          temperature=0, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    first = events[-1].response
    follow = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="Again?", max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id and follow.status in ("completed",
                                                                         "incomplete")


def test_ids_the_gateway_never_saw_are_found_on_the_replicas(fleet: FleetHandle,
                                                             client: openai.OpenAI) -> None:
    replica = list(fleet.replicas)[1]
    made = httpx.post(f"{replica}/v1/responses", timeout=60,
                      json={"model": MODEL, "input": "Hi", "max_output_tokens": 4}).json()
    assert client.responses.retrieve(made["id"]).id == made["id"]
    items = client.responses.input_items.list(made["id"]).data
    assert [i.content[0].text for i in items] == ["Hi"]


def test_unknown_ids_are_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve("resp_unknown")
    assert exc.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as exc:  # the replica's own validation
        client.responses.create(model=MODEL, input="Hi", extra_body={"frobnicate": 1})
    assert exc.value.body["param"] == "frobnicate"


def test_background_cancel_and_stream_retrieve_reach_the_owner(fleet: FleetHandle,
                                                               client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=900, background=True,
        extra_body={"ignore_eos": True})
    backend = raw.headers["x-argosy-backend"]
    made = raw.parse()
    assert made.status in ("queued", "in_progress") and _holders(fleet, made.id) == [backend]
    # its events come through as they are made: a buffering relay would wait for the end
    stream = client.responses.retrieve(made.id, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) == 3:
            break
    assert client.responses.cancel(made.id).status == "cancelled"
    seen += list(stream)  # the cancel ends it (OpenAI's stream has no cancelled event)
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    replayed = list(client.responses.retrieve(made.id, stream=True, starting_after=2))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in seen[3:]]
    assert client.responses.retrieve(made.id).status == "cancelled"
    deadline = time.monotonic() + 1.0  # the replica aborted it: nothing runs there
    while _running(backend) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(backend) == 0


def _running(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("argosy:num_requests_running{"))
