"""Client mistakes on the Batch and Responses APIs end in a clear error, never in a request
lost without a word.

A batch input line the in-process POST could not send (NaN or Infinity, which Python's json
reads but no JSON encoder writes; a lone UTF-16 surrogate, which is not Unicode) used to pass
the input checks and then vanish: its task raised, nothing reached the result files and the
batch still ended `completed`, with `completed + failed < total`.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from argosy_runtime.server.batch.batch_input import read_batch_input
from serve_harness import wait_for_batch

CHAT = "/v1/chat/completions"


def _line(custom_id: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 3, **body}})


# ---- the input checks, without a server --------------------------------------------------
def test_lines_the_runner_could_not_send_are_invalid_json(tmp_path: Path) -> None:
    good = _line("ok")
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        good,
        _line("nan", temperature=0).replace('"temperature": 0', '"temperature": NaN'),
        _line("inf", temperature=0).replace('"temperature": 0', '"temperature": -Infinity'),
        _line("lone").replace('"hi"', '"\\ud800"'),                 # in the body
        _line("x").replace('"x"', '"id\\udc00"'),                   # in the custom_id
        _line("deep").replace('"hi"', "[" * 100_000 + "]" * 100_000),
        _line("pair").replace('"hi"', '"\\ud83d\\ude00"'),          # a valid pair is fine
        _line("text").replace('"hi"', '"NaN and Infinity"'),        # as text they are fine
    ]) + "\n")
    lines, errors = read_batch_input(path, CHAT)
    assert lines == []
    assert [(e["line"], e["code"]) for e in errors] == [(n, "invalid_json_line")
                                                        for n in (2, 3, 4, 5, 6)], errors
    assert "NaN" in errors[0]["message"] and "-Infinity" in errors[1]["message"]
    assert "surrogate" in errors[2]["message"] and "surrogate" in errors[3]["message"]
    assert "nested too deeply" in errors[4]["message"]


# ---- on the real server -------------------------------------------------------------------
@pytest.mark.slow
def test_a_line_with_nan_fails_the_batch_instead_of_vanishing(client: openai.OpenAI) -> None:
    data = "\n".join([
        _line("a"),
        _line("b", temperature=0).replace('"temperature": 0', '"temperature": NaN'),
        _line("c").replace('"hi"', '"\\ud800"'),
    ]) + "\n"
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data.encode())),
                                  purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id)
    # was: completed, request_counts (total 3, completed 1, failed 0), "b" and "c" in no file
    assert batch.status == "failed", batch
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_json_line"),
                                                             (3, "invalid_json_line")]
    assert batch.output_file_id is None and batch.error_file_id is None


@pytest.mark.slow
@pytest.mark.parametrize("rest", ["a" * 300, "\U0001d7d8" * 64])  # 300 bytes, 256 bytes
def test_an_id_too_long_for_a_file_name_is_a_404(http: httpx.Client, rest: str) -> None:
    """An id naming a path past the file system's 255-byte name limit raised OSError
    (ENAMETOOLONG): a 500 instead of the 404 any other unknown id gets."""
    for method, path, code in [
            ("GET", f"/v1/files/file-{rest}", "file_not_found"),
            ("GET", f"/v1/files/file-{rest}/content", "file_not_found"),
            ("DELETE", f"/v1/files/file-{rest}", "file_not_found"),
            ("GET", f"/v1/batches/batch_{rest}", "batch_not_found"),
            ("POST", f"/v1/batches/batch_{rest}/cancel", "batch_not_found")]:
        r = http.request(method, path)
        assert r.status_code == 404, (method, path[:30], r.text)
        assert r.json()["error"]["code"] == code
    r = http.post("/v1/batches", json={"input_file_id": f"file-{rest}", "endpoint": CHAT,
                                       "completion_window": "24h"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found", r.text


# ---- the runner, against a small ASGI endpoint (test_batch_runner.py) ---------------------
async def test_a_result_that_cannot_be_written_fails_the_batch(tmp_path: Path) -> None:
    """A request whose result cannot be recorded (a full disk, a bug) fails the batch, as a
    broken batch does (`_run_guarded`), instead of leaving it out of a `completed` batch."""
    from test_batch_runner import Endpoint, _finish, _runner

    endpoint = Endpoint()
    endpoint.gate = asyncio.Event()
    runner, file_id = _runner(tmp_path, endpoint)
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    while not endpoint.bodies:  # the first request is in: the result files were opened
        await asyncio.sleep(0.01)
    (tmp_path / "batches" / f"{batch['id']}.output.jsonl").mkdir()  # cannot be appended to
    endpoint.gate.set()
    batch = await _finish(runner, batch)
    await runner.shutdown()
    # was: completed, request_counts (total 3, completed 0, failed 0)
    assert batch["status"] == "failed", batch
    assert batch["errors"]["data"][0]["code"] == "internal_error"
    assert "IsADirectoryError" in batch["errors"]["data"][0]["message"]


async def test_a_cancelled_batch_goes_cancelling_to_cancelled(tmp_path: Path) -> None:
    """As the design says (batch_runner.py), not through `finalizing`, which OpenAI keeps
    for a batch whose requests all ran: a client polling another replica saw
    cancelling -> finalizing -> cancelled, and the cancelled record kept a `finalizing_at`."""
    from test_batch_runner import Endpoint, _finish, _runner

    endpoint = Endpoint()
    endpoint.gate = asyncio.Event()  # the first request stays running until cancelled
    runner, file_id = _runner(tmp_path, endpoint)
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    while not endpoint.bodies:
        await asyncio.sleep(0.01)
    assert runner.cancel(batch["id"])["status"] == "cancelling"
    # A second cancel before it ends answers as the first (as through another replica), no 409.
    assert runner.cancel(batch["id"])["status"] == "cancelling"
    batch = await _finish(runner, batch)
    await runner.shutdown()
    assert batch["status"] == "cancelled", batch
    assert batch["cancelling_at"] is not None and batch["cancelled_at"] is not None
    assert batch["finalizing_at"] is None and batch["completed_at"] is None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert len(endpoint.bodies) == 1  # nothing new started after the cancel
    on_disk = json.loads((tmp_path / "batches" / f"{batch['id']}.json").read_text())
    assert on_disk == batch
