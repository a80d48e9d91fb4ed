"""The Batch API's input checks and result files, without a server."""

from __future__ import annotations

import json
from pathlib import Path

from argosy_runtime.server.batch.batch_input import read_batch_input
from argosy_runtime.server.batch.batch_results import BatchResults

CHAT = "/v1/chat/completions"


def _line(custom_id: str, **overrides: object) -> str:
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "hi"}]}, **overrides}
    return json.dumps(item)


def _read(tmp_path: Path, *lines: str) -> tuple[list, list]:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return read_batch_input(path, CHAT)


def test_a_valid_file_gives_its_requests_in_order(tmp_path: Path) -> None:
    lines, errors = _read(tmp_path, _line("a"), "", _line("b"))
    assert errors == []
    assert [(ln.number, ln.custom_id) for ln in lines] == [(1, "a"), (3, "b")]
    assert lines[0].body == {"messages": [{"role": "user", "content": "hi"}]}


def test_every_problem_is_listed_by_line_and_nothing_runs(tmp_path: Path) -> None:
    lines, errors = _read(
        tmp_path,
        _line("a"),
        "{not json",
        _line("a"),                                   # duplicate
        _line("c", url="/v1/completions"),            # another endpoint
        _line("d", method="GET"),
        _line("e", body=[1, 2]),
        _line("f", body={"messages": [], "stream": True}),
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),  # no custom_id
        _line("h", extra=1),
        _line("i", body={"messages": [], "background": True}),
    )
    assert lines == []
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_endpoint"),
        (5, "invalid_method"), (6, "invalid_body"), (7, "invalid_body"),
        (8, "missing_required_parameter"), (9, "invalid_request"), (10, "invalid_body")]
    assert errors[6]["param"] == "custom_id"
    assert errors[8]["param"] == "body.background"


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    assert _read(tmp_path, "", "  ")[1][0]["code"] == "empty_file"


def test_usage_sums_cached_and_reasoning_tokens_of_chat_and_responses_answers(tmp_path: Path
                                                                               ) -> None:
    results = BatchResults.open(tmp_path, "batch_u")
    results.add("chat", 200, "rid-1", {"usage": {
        "prompt_tokens": 10, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 5}}})
    results.add("responses", 200, "rid-2", {"usage": {
        "input_tokens": 6, "output_tokens": 9, "input_tokens_details": {"cached_tokens": 2},
        "output_tokens_details": {"reasoning_tokens": 3}}})
    results.add("plain", 200, "rid-3", {"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    expected = {"input_tokens": 17, "output_tokens": 18, "total_tokens": 35,
                "input_tokens_details": {"cached_tokens": 6},
                "output_tokens_details": {"reasoning_tokens": 8}}
    assert results.usage() == expected
    assert BatchResults.open(tmp_path, "batch_u").usage() == expected  # read back the same


def test_results_are_read_back_and_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    results = BatchResults.open(tmp_path, "batch_x")
    ok = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    results.add("a", 200, "rid-1", ok)
    results.add("b", 400, "rid-2", {"error": {"message": "bad", "type": "invalid_request_error",
                                              "code": None}})
    results.add_expired("c")
    with results.output_path.open("a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "d", "respo')  # a crash mid-write

    again = BatchResults.open(tmp_path, "batch_x")
    assert again.done == {"a", "b", "c"}
    assert (again.completed, again.failed) == (1, 2)
    assert again.usage()["total_tokens"] == 12
    errors = [json.loads(x) for x in again.error_path.read_text().splitlines()]
    assert [e["error"]["code"] for e in errors] == ["invalid_request_error", "batch_expired"]
    assert errors[0]["response"]["status_code"] == 400
    # The torn line is gone, so the next record starts on a line of its own.
    again.add("d", 200, "rid-4", ok)
    assert [json.loads(x)["custom_id"] for x in
            again.output_path.read_text().splitlines()] == ["a", "d"]
