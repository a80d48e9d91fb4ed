"""The Batch API (/v1/files, /v1/batches) through the official openai client, on real servers.

On the shared server: a batch's answers equal the live endpoint's, a bad request is that
line's error, an unusable file fails the batch, files can be listed, read and deleted, and a
cancelled batch stops and leaks no KV blocks. On a server of its own (`--batch-dir`, an API
key, two sequence slots): live requests preempt batch requests, and a batch interrupted by a
SIGTERM resumes when a new server starts on the same folder.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_harness import ServerProcess, wait_for_batch

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _upload(client: openai.OpenAI, items: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(item) + "\n" for item in items).encode()
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


def _chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": content}], "temperature": 0,
                     "max_tokens": 12, **body}}


def _completion_line(custom_id: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS,
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True}}


def _records(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    lines = client.files.content(file_id).text.splitlines()
    records = [json.loads(line) for line in lines]
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records), "a request was answered twice"
    return by_id


def test_batch_answers_equal_the_live_endpoint(client: openai.OpenAI) -> None:
    items = [_chat_line(f"q{i}", f"Name {i + 2} colours.") for i in range(4)]
    items.append(_chat_line("too-long", "hi", max_tokens=10**6))  # the endpoint's 400
    input_id = _upload(client, items)
    created = client.batches.create(input_file_id=input_id, endpoint=CHAT,
                                    completion_window="24h", metadata={"job": "colours"})
    assert created.status in ("validating", "in_progress")
    batch = wait_for_batch(client, created.id)

    assert batch.status == "completed"
    assert batch.metadata == {"job": "colours"}
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (5, 4, 1)
    outputs = _records(client, batch.output_file_id)
    errors = _records(client, batch.error_file_id)
    assert set(outputs) == {"q0", "q1", "q2", "q3"} and set(errors) == {"too-long"}
    prompt_tokens = completion_tokens = 0
    for item in items[:4]:
        live = client.chat.completions.create(model="smollm2-135m", **item["body"])
        record = outputs[item["custom_id"]]
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert body["usage"]["completion_tokens"] == live.usage.completion_tokens
        prompt_tokens += live.usage.prompt_tokens
        completion_tokens += live.usage.completion_tokens
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt_tokens,
                                                                     completion_tokens)
    # The four lines share the chat template's system prompt: later ones hit the prefix cache.
    cached = sum(outputs[i["custom_id"]]["response"]["body"]["usage"]["prompt_tokens_details"]
                 ["cached_tokens"] for i in items[:4])
    assert batch.usage.input_tokens_details.cached_tokens == cached
    failed = errors["too-long"]
    assert failed["response"]["status_code"] == 400
    assert failed["error"]["code"] == "context_length_exceeded"
    assert client.batches.list().data[0].id == batch.id
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_a_responses_batch_answers_as_the_live_endpoint(client: openai.OpenAI) -> None:
    items = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "smollm2-135m", "input": f"Name {i + 2} fruits.",
                       "max_output_tokens": 12, "temperature": 0}} for i in range(2)]
    batch = client.batches.create(input_file_id=_upload(client, items), endpoint="/v1/responses",
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    outputs = _records(client, batch.output_file_id)
    output_tokens = 0
    for item in items:
        answer = outputs[item["custom_id"]]["response"]["body"]
        live = client.responses.create(**item["body"], store=False)
        assert answer["object"] == "response" and answer["store"] is False
        assert answer["output"][0]["content"][0]["text"] == live.output_text
        output_tokens += answer["usage"]["output_tokens"]
    assert batch.usage.output_tokens == output_tokens > 0
    with pytest.raises(openai.NotFoundError):  # batch answers are not kept as responses
        client.responses.retrieve(outputs["r0"]["response"]["body"]["id"])


def test_an_unusable_input_file_fails_the_batch_with_its_lines(client: openai.OpenAI) -> None:
    items = [_chat_line("a", "hi"), _chat_line("a", "again"),
             {**_chat_line("b", "hi"), "url": COMPLETIONS}]
    batch = client.batches.create(input_file_id=_upload(client, items), endpoint=CHAT,
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "duplicate_custom_id"), (3, "mismatched_endpoint")]
    assert batch.output_file_id is None and batch.error_file_id is None


def test_bad_batch_and_file_requests_are_clear_4xx(client: openai.OpenAI) -> None:
    input_id = _upload(client, [_chat_line("a", "hi")])
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(input_file_id=input_id, endpoint="/v1/moderations",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=input_id, endpoint=CHAT, completion_window="1h")
    with pytest.raises(openai.NotFoundError, match="no file"):
        client.batches.create(input_file_id="file-missing", endpoint=CHAT,
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no batch"):
        client.batches.retrieve("batch_missing")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"")), purpose="batch")


def test_files_can_be_listed_read_and_deleted(client: openai.OpenAI) -> None:
    data = b'{"custom_id": "a"}\n'
    uploaded = client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(data), "mine.jsonl",
                                                                     "batch")
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(uploaded.id).content == data
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content("../files/" + uploaded.id)


def test_cancel_stops_a_batch_and_frees_its_kv_blocks(client: openai.OpenAI,
                                                      server: ServerProcess) -> None:
    items = [_completion_line(f"c{i}", f"Story {i}:", 400) for i in range(12)]
    batch = client.batches.create(input_file_id=_upload(client, items), endpoint=COMPLETIONS,
                                  completion_window="24h")
    wait_for_batch(client, batch.id, until=lambda b: b.status == "in_progress")
    assert server.metrics()["argosy:batch_requests_pending"] > 0
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed < 12
    assert len(_records(client, batch.output_file_id)) == batch.request_counts.completed
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    deadline = time.monotonic() + 30
    while (m := server.metrics())["argosy:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "aborted batch requests still running"
        time.sleep(0.2)
    assert m["argosy:kv_cache_usage_perc"] == 0.0
    assert m["argosy:batch_requests_pending"] == 0
    # ids never become metric series: the path label is the route
    text = httpx.get(server.url + "/metrics").text
    assert 'path="/v1/batches/{id}/cancel"' in text and "batch_" not in text.replace(
        "argosy:batch_requests_pending", "")
    # Requests the cancel aborted are the client's leaving (499), not server errors (500).
    assert 'path="/v1/completions",status="499"' in text
    assert 'status="500"' not in text


# ---- a server of its own: priorities and resume after a restart --------------------------
KEY = "batch-test-key"
SLOTS = 2


def _own_server(batch_dir: Path) -> ServerProcess:
    return ServerProcess("--batch-dir", str(batch_dir), "--max-num-seqs", str(SLOTS),
                         "--drain-timeout", "5", env={"ARGOSY_API_KEY": KEY}).wait_ready()


def _client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def own(batch_dir: Path) -> Iterator[ServerProcess]:
    proc = _own_server(batch_dir)
    try:
        yield proc
    finally:
        proc.stop()


def test_live_requests_preempt_batch_requests(own: ServerProcess) -> None:
    client = _client(own)
    items = [_completion_line(f"p{i}", f"Poem {i}:", 300) for i in range(4)]
    batch = client.batches.create(input_file_id=_upload(client, items), endpoint=COMPLETIONS,
                                  completion_window="24h")
    deadline = time.monotonic() + 60
    while own.metrics()["argosy:num_requests_running"] < SLOTS:  # batch requests fill the slots
        assert time.monotonic() < deadline
        time.sleep(0.1)
    preemptions = own.metrics()["argosy:num_preemptions_total"]
    live = client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=4)
    assert live.choices[0].finish_reason == "length"
    assert client.batches.retrieve(batch.id).request_counts.completed == 0  # it did not wait
    assert own.metrics()["argosy:num_preemptions_total"] > preemptions
    client.batches.cancel(batch.id)
    assert wait_for_batch(client, batch.id).status == "cancelled"


def test_a_batch_cut_by_sigterm_resumes_on_the_next_start(own: ServerProcess,
                                                          batch_dir: Path) -> None:
    client = _client(own)
    items = [_completion_line(f"r{i}", f"Item {i} is", 40) for i in range(8)]
    batch = client.batches.create(input_file_id=_upload(client, items), endpoint=COMPLETIONS,
                                  completion_window="24h")
    wait_for_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    assert own.stop() == 0  # SIGTERM: drains, exits 0
    on_disk = json.loads((batch_dir / "batches" / f"{batch.id}.json").read_text())
    assert on_disk["status"] == "in_progress"

    again = _own_server(batch_dir)
    try:
        client = _client(again)
        batch = wait_for_batch(client, batch.id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (8, 0)
        outputs = _records(client, batch.output_file_id)
        assert set(outputs) == {item["custom_id"] for item in items}
        for item in items[:3]:
            body = dict(item["body"])
            live = client.completions.create(
                model="smollm2-135m", extra_body={"ignore_eos": body.pop("ignore_eos")}, **body)
            text = outputs[item["custom_id"]]["response"]["body"]["choices"][0]["text"]
            assert text == live.choices[0].text
    finally:
        again.stop()


def test_a_replica_sharing_the_folder_finishes_a_batch_whose_replica_stopped(
        tmp_path: Path) -> None:
    # Two replicas on one --batch-dir (a ReadWriteMany volume in a cluster): both answer for
    # the batch, only the one that created it runs it; when that one is told to stop, the
    # other takes it over and every request is answered exactly once.
    first, second = _own_server(tmp_path), _own_server(tmp_path)
    try:
        client, other = _client(first), _client(second)
        items = [_completion_line(f"s{i}", f"Step {i}:", 40) for i in range(8)]
        batch = client.batches.create(input_file_id=_upload(other, items),  # any replica's file
                                      endpoint=COMPLETIONS, completion_window="24h")
        wait_for_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
        assert other.batches.retrieve(batch.id).status == "in_progress"
        assert first.metrics()["argosy:batch_requests_pending"] > 0
        assert second.metrics()["argosy:batch_requests_pending"] == 0  # runs on one replica
        assert first.stop() == 0  # SIGTERM: drains, leaves the rest to the other replica
        batch = wait_for_batch(other, batch.id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (8, 0)
        lines = other.files.content(batch.output_file_id).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in lines) == sorted(
            item["custom_id"] for item in items)  # each exactly once
    finally:
        first.stop()
        second.stop()
