"""BatchRunner's failure paths, against a small ASGI endpoint that answers the way a busy or
stopping server does (429s, aborted answers) - states a real server reaches only by timing.
The happy paths run on the real server in test_batch_api.py."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from argosy_runtime.server.batch import batch_results, batch_runner
from argosy_runtime.server.batch.batch_runner import BatchRunner
from argosy_runtime.server.batch.file_store import FileStore
from argosy_runtime.server.errors import APIError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class Endpoint:
    """POST /v1/completions: answers from a script, then 200s; records what it received."""

    def __init__(self, script: list[tuple[int, dict[str, Any]]] | None = None,
                 on_request: Any = None) -> None:
        self.script = list(script or [])
        self.on_request = on_request  # called with the number of requests so far
        self.gate: asyncio.Event | None = None  # when set, each request waits for it
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.app = Starlette(routes=[Route("/v1/completions", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> JSONResponse:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        if self.on_request is not None:
            self.on_request(len(self.bodies))
        if self.gate is not None:
            await self.gate.wait()
        if self.script:
            status, body = self.script.pop(0)
            return JSONResponse(body, status_code=status)
        return JSONResponse({"choices": [{"text": "ok", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 2, "completion_tokens": 3}})


def _runner(tmp_path: Path, endpoint: Endpoint, draining: list[bool] | None = None,
            api_key: str | None = None) -> tuple[BatchRunner, str]:
    files = FileStore(tmp_path)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"p{i}", "max_tokens": 3}} for i in range(3)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = files.create(io.BytesIO(data), "in.jsonl", "batch")["id"]
    flag = draining if draining is not None else [False]
    runner = BatchRunner(tmp_path, files, endpoint.app, concurrency=1, api_key=api_key,
                         is_draining=lambda: flag[0])
    return runner, file_id


async def _finish(runner: BatchRunner, batch: dict[str, Any]) -> dict[str, Any]:
    for _ in range(500):
        if batch["id"] not in runner._tasks:
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch still running: {batch}")


async def test_a_full_server_is_retried_not_recorded(tmp_path: Path) -> None:
    busy = {"error": {"message": "full", "type": "rate_limit_error", "code": "queue_full"}}
    endpoint = Endpoint([(429, busy), (503, busy)])
    runner, file_id = _runner(tmp_path, endpoint)
    await runner.start()
    batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
    await runner.shutdown()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(endpoint.bodies) == 5  # the first line was sent three times
    assert all(body["priority"] == 1 for body in endpoint.bodies)
    assert batch["usage"]["total_tokens"] == 15


async def test_an_expired_batch_records_its_unrun_lines(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(batch_runner.COMPLETION_WINDOW_S, "24h", 0)
    endpoint = Endpoint()
    runner, file_id = _runner(tmp_path, endpoint)
    await runner.start()
    batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
    await runner.shutdown()
    assert batch["status"] == "expired" and endpoint.bodies == []
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    errors = (tmp_path / "files" / batch["error_file_id"]).read_text().splitlines()
    assert {json.loads(e)["error"]["code"] for e in errors} == {"batch_expired"}


async def test_answers_cut_by_a_drain_stay_pending_and_resume(tmp_path: Path) -> None:
    draining = [False]
    aborted = {"choices": [{"text": "par", "finish_reason": "abort"}]}
    # SIGTERM arrives while the second request runs; the drain then aborts it.
    endpoint = Endpoint([(200, {"choices": [{"text": "ok", "finish_reason": "stop"}],
                                "usage": {}}), (200, aborted)],
                        on_request=lambda n: draining.__setitem__(0, n >= 2))
    runner, file_id = _runner(tmp_path, endpoint, draining)
    await runner.start()
    batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
    await runner.shutdown()
    assert len(endpoint.bodies) == 2  # nothing new started while draining
    assert batch["status"] == "in_progress"
    assert batch["request_counts"]["completed"] == 1  # the aborted answer is not a result

    batch = await _resume(tmp_path, runner, endpoint, draining, batch["id"])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    output = (tmp_path / "files" / batch["output_file_id"]).read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in output) == ["c0", "c1", "c2"]


async def _resume(tmp_path: Path, runner: BatchRunner, endpoint: Endpoint,
                  draining: list[bool], batch_id: str) -> dict:
    """Start a new runner on the same folder (a restart, or another replica taking over),
    no longer draining, and run the batch it finds to its end."""
    endpoint.on_request = None
    draining[0] = False
    again = BatchRunner(tmp_path, runner.files, endpoint.app, concurrency=1)
    await again.start()
    batch = await _finish(again, again.batches[batch_id])
    await again.shutdown()
    return batch


async def test_a_batch_that_breaks_fails_visibly(tmp_path: Path) -> None:
    runner, file_id = _runner(tmp_path, Endpoint())
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    (tmp_path / "batches" / f"{batch['id']}.output.jsonl").mkdir()  # cannot be appended to
    batch = await _finish(runner, batch)
    await runner.shutdown()
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "internal_error"


async def test_a_batch_that_breaks_midway_publishes_the_answers_it_had(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its result files stayed in the folder for good: unreachable, and never cleaned up.
    append = batch_results.BatchResults._append

    def disk_full_after_one(self: batch_results.BatchResults, record: dict[str, Any]) -> None:
        if self.completed:
            raise OSError(errno.ENOSPC, "No space left on device")
        append(self, record)

    monkeypatch.setattr(batch_results.BatchResults, "_append", disk_full_after_one)
    runner, file_id = _runner(tmp_path, Endpoint(script=[(200, {
        "choices": [{"text": "first", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3}})]))
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    batch = await _finish(runner, batch)
    await runner.shutdown()
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "internal_error"
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert batch["usage"]["input_tokens"] == 2
    [answer] = [json.loads(line) for line in
                runner.files.content_path(batch["output_file_id"]).read_text().splitlines()]
    assert answer["custom_id"] == "c0"
    assert answer["response"]["body"]["choices"][0]["text"] == "first"
    assert not (tmp_path / "batches" / f"{batch['id']}.output.jsonl").exists()


async def test_an_input_file_deleted_after_create_still_runs_and_resumes(
        tmp_path: Path) -> None:
    """OpenAI lets a client delete a batch's input file while the batch runs. The batch
    used to read the input from the store: deleted before validation it failed, and deleted
    while it ran, a restart (or another replica taking it over) failed it on resume with its
    answers so far left in `batches/` for good. It keeps its own link to the bytes now."""
    draining = [False]
    endpoint = Endpoint(on_request=lambda n: draining.__setitem__(0, n >= 1))
    runner, file_id = _runner(tmp_path, endpoint, draining)
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    runner.files.delete(file_id)  # before the batch has read it
    batch = await _finish(runner, batch)
    await runner.shutdown()
    assert batch["status"] == "in_progress"  # drained after its first request
    assert batch["request_counts"]["completed"] == 1

    batch = await _resume(tmp_path, runner, endpoint, draining, batch["id"])
    assert batch["status"] == "completed", batch  # was: failed, file_not_found
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(endpoint.bodies) == 3
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [f"{batch['id']}.json"]


async def test_an_input_file_deleted_as_the_batch_is_created_is_a_404(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its metadata read, its bytes gone (deleted meanwhile, here or by another replica): the
    # create is a 404 naming the field, and leaves nothing behind.
    runner, file_id = _runner(tmp_path, Endpoint())
    await runner.start()
    get = runner.files.get

    def get_then_deleted(file_id: str, owner: str | None = None) -> dict[str, Any]:
        meta = get(file_id, owner)
        (tmp_path / "files" / file_id).unlink(missing_ok=True)
        return meta

    monkeypatch.setattr(runner.files, "get", get_then_deleted)
    with pytest.raises(APIError) as caught:
        runner.create(file_id, "/v1/completions", "24h", None)
    await runner.shutdown()
    error = caught.value
    assert (error.status, error.code, error.param) == (404, "file_not_found", "input_file_id")
    assert list((tmp_path / "batches").iterdir()) == [] and runner.batches == {}


async def test_batch_requests_log_nothing_through_httpx(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The access log has a line per batch request; httpx adds none, and the runner leaves
    the process-wide `httpx` logger as it found it (other clients keep their INFO lines)."""
    endpoint = Endpoint()
    runner, file_id = _runner(tmp_path, endpoint, api_key="sk-test")
    with caplog.at_level(logging.INFO, logger="httpx"):
        await runner.start()
        batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
        await runner.shutdown()
        assert logging.getLogger("httpx").level == logging.INFO
    assert batch["status"] == "completed" and len(endpoint.bodies) == 3
    assert [r.getMessage() for r in caplog.records if r.name.startswith("httpx")] == []
    assert {h["authorization"] for h in endpoint.headers} == {"Bearer sk-test"}
    assert sorted(h["x-request-id"] for h in endpoint.headers) == [
        f"{batch['id']}-{n}" for n in (1, 2, 3)]


async def test_an_owned_batch_runs_as_its_owner_and_owns_its_output(tmp_path: Path) -> None:
    """A batch a gateway tenant created (owners.py) sends its requests naming that owner, so
    a line's previous_response_id reaches only the owner's responses; its output file is the
    owner's. A batch made without an owner names none, as before."""
    endpoint = Endpoint()
    runner, file_id = _runner(tmp_path, endpoint)
    runner.files.delete(file_id)
    owned = runner.files.create(io.BytesIO(b'{"custom_id": "c", "method": "POST", "url": '
                                           b'"/v1/completions", "body": {}}\n'),
                                "in.jsonl", "batch", owner="team-a")["id"]
    await runner.start()
    batch = await _finish(runner, runner.create(owned, "/v1/completions", "24h", None,
                                                owner="team-a"))
    await runner.shutdown()
    assert batch["status"] == "completed"
    assert [h.get("x-argosy-owner") for h in endpoint.headers] == ["team-a"]
    assert runner.files.get(batch["output_file_id"], "team-a")["owner"] == "team-a"
    with pytest.raises(APIError):
        runner.files.get(batch["output_file_id"], "team-b")


# ---- replicas sharing one --batch-dir ----------------------------------------------------------

async def _until(check: Any, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _custom_ids(tmp_path: Path, batch: dict[str, Any]) -> list[str]:
    output = (tmp_path / "files" / batch["output_file_id"]).read_text().splitlines()
    return sorted(json.loads(x)["custom_id"] for x in output)


async def test_a_replica_takes_over_the_batch_of_one_that_drained(tmp_path: Path) -> None:
    # Replica A runs a batch and drains after its first answer; replica B, on the same folder,
    # sees it while A runs it (and leaves it alone), then takes it over and finishes it.
    draining = [False]
    first = Endpoint(on_request=lambda n: draining.__setitem__(0, n >= 1))
    first.gate = asyncio.Event()
    a, file_id = _runner(tmp_path, first, draining)
    second = Endpoint()
    b = BatchRunner(tmp_path, FileStore(tmp_path), second.app, concurrency=1,
                    scan_interval_s=0.02)
    await a.start()
    await b.start()
    batch = a.create(file_id, "/v1/completions", "24h", None)
    await _until(lambda: first.bodies, "A's first request")
    await asyncio.sleep(0.1)  # several of B's scans while A holds the batch
    assert second.bodies == [] and batch["id"] not in b.batches
    assert b.get(batch["id"])["status"] == "in_progress"
    assert [x["id"] for x in b.list()] == [batch["id"]]
    first.gate.set()  # A answers its one request and stops there (draining)
    await _until(lambda: batch["id"] not in a.batches and second.bodies, "B taking it over")
    done = await _finish(b, b.batches.get(batch["id"]) or b.get(batch["id"]))
    await a.shutdown()
    await b.shutdown()
    final = a.get(batch["id"])  # A reads it back from the folder
    assert final["status"] == "completed" == done["status"]
    assert final["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(first.bodies) == 1 and len(second.bodies) == 2  # each line ran once
    assert _custom_ids(tmp_path, final) == ["c0", "c1", "c2"]
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()
                  if p.suffix in (".lock", ".cancel")) == []  # nothing left behind


async def test_scans_read_a_finished_batch_no_more(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runner, file_id = _runner(tmp_path, Endpoint())
    await runner.start()
    batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
    await runner.shutdown()
    assert batch["status"] == "completed"
    reads: list[Path] = []
    read = batch_runner.read_json_record
    monkeypatch.setattr(batch_runner, "read_json_record", lambda p: reads.append(p) or read(p))
    runner._take_over_orphans()
    runner._take_over_orphans()
    assert len(reads) == 1  # the first scan after it finished, then never again


async def test_a_cancel_through_another_replica_reaches_the_runner(tmp_path: Path) -> None:
    endpoint = Endpoint()
    endpoint.gate = asyncio.Event()  # A's requests hang until cancelled
    a, file_id = _runner(tmp_path, endpoint)
    a.scan_interval_s = 0.02
    b = BatchRunner(tmp_path, FileStore(tmp_path), Endpoint().app, concurrency=1)
    await a.start()
    await b.start()
    batch = a.create(file_id, "/v1/completions", "24h", None)
    await _until(lambda: endpoint.bodies, "A's first request")
    answer = b.cancel(batch["id"])
    assert answer["status"] == "cancelling" and answer["id"] == batch["id"]
    batch = await _finish(a, batch)
    await a.shutdown()
    await b.shutdown()
    assert batch["status"] == "cancelled" and len(endpoint.bodies) == 1
    assert b.get(batch["id"])["status"] == "cancelled"
    assert batch["request_counts"]["completed"] == 0  # the cut request is not a result


async def test_a_cancel_through_another_replica_shows_cancelling_until_it_ends(
        tmp_path: Path) -> None:
    """Until the runner acts on the marker (its next scan, or its next free slot), a
    retrieve or list through any replica showed the batch `in_progress` again right after
    the cancel answered `cancelling`; a second cancel answered another `cancelling_at`."""
    endpoint = Endpoint()
    endpoint.gate = asyncio.Event()  # A's one slot stays busy: it does not see the marker
    a, file_id = _runner(tmp_path, endpoint)
    a.scan_interval_s = 60.0
    b = BatchRunner(tmp_path, FileStore(tmp_path), Endpoint().app, concurrency=1,
                    scan_interval_s=60.0)
    await a.start()
    await b.start()
    batch = a.create(file_id, "/v1/completions", "24h", None)
    await _until(lambda: endpoint.bodies, "A's first request")
    answer = b.cancel(batch["id"])
    assert answer["status"] == "cancelling"
    for runner in (b, a):
        assert runner.get(batch["id"])["status"] == "cancelling"
        assert [x["status"] for x in runner.list()] == ["cancelling"]
    assert b.cancel(batch["id"])["cancelling_at"] == answer["cancelling_at"]
    endpoint.gate.set()  # the slot frees: A sees the marker and ends the batch
    batch = await _finish(a, batch)
    await a.shutdown()
    await b.shutdown()
    assert batch["status"] == "cancelled" == b.get(batch["id"])["status"]
    assert len(endpoint.bodies) == 1


async def test_batch_ids_outside_the_folder_are_404(tmp_path: Path) -> None:
    runner, _ = _runner(tmp_path, Endpoint())
    (tmp_path / "secret.json").write_text('{"id": "x"}')
    for bad in ("../secret", "batch_../../secret", "batch_x/../../secret"):
        with pytest.raises(APIError) as caught:
            runner.get(bad)
        assert caught.value.status == 404


def test_answers_cut_short_by_the_server_are_recognised_on_every_endpoint() -> None:
    was_aborted = batch_runner._was_aborted
    assert was_aborted({"choices": [{"finish_reason": "stop"}, {"finish_reason": "abort"}]})
    assert not was_aborted({"choices": [{"finish_reason": "length"}]})
    # /v1/responses: a drain or abort ends the response `failed` (responses/response_object.py)
    from argosy_runtime.server.responses.response_object import ABORTED, outcome_of

    failed = outcome_of("abort")
    assert was_aborted({"object": "response", "status": failed.status, "error": ABORTED})
    assert not was_aborted({"object": "response", "status": outcome_of("length").status})


async def test_a_crash_while_finalizing_neither_reruns_nor_orphans_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process stops (here: its task is cancelled) after the output file entered the
    store and before the final status was saved. The next start finishes the batch from its
    result files: no request runs twice, and the store holds one output file, not two."""
    endpoint = Endpoint()
    runner, file_id = _runner(tmp_path, endpoint)
    adopt = runner.files.adopt

    def adopt_then_die(*args: Any) -> dict[str, Any]:
        adopt(*args)
        raise asyncio.CancelledError

    monkeypatch.setattr(runner.files, "adopt", adopt_then_die)
    await runner.start()
    batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
    await runner.shutdown()
    assert batch["status"] == "finalizing"

    again = BatchRunner(tmp_path, FileStore(tmp_path), endpoint.app, concurrency=1)
    await again.start()
    batch = await _finish(again, again.batches[batch["id"]])
    await again.shutdown()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(endpoint.bodies) == 3  # nothing ran again
    outputs = [f for f in again.files.list() if f["purpose"] == "batch_output"]
    assert [f["id"] for f in outputs] == [batch["output_file_id"]]
    output = (tmp_path / "files" / batch["output_file_id"]).read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in output) == ["c0", "c1", "c2"]
    assert not list((tmp_path / "batches").glob("*.jsonl"))  # working files gone once final


async def test_a_batch_cancelled_while_validating_a_bad_file_ends_cancelled(
        tmp_path: Path) -> None:
    """OpenAI's cancel: cancelling, then cancelled. A cancel that lands while the input file
    is read (a FIFO holds the read open until the test writes it) still ends `cancelled`
    when the file turns out unusable, not `failed`; its errors stay listed."""
    endpoint = Endpoint()
    runner, file_id = _runner(tmp_path, endpoint)
    fifo = runner.files.dir / file_id
    fifo.unlink()
    os.mkfifo(fifo)
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    await asyncio.sleep(0.05)  # the runner is now reading (blocked on) the input file
    assert batch["status"] == "validating"
    assert runner.cancel(batch["id"])["status"] == "cancelling"

    def write_bad_input() -> None:
        with fifo.open("wb") as f:
            f.write(b"not json\n")

    await asyncio.to_thread(write_bad_input)
    batch = await _finish(runner, batch)
    await runner.shutdown()
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert batch["failed_at"] is None and endpoint.bodies == []
    assert batch["errors"]["data"][0]["code"] == "invalid_json_line"
    assert runner.get(batch["id"])["status"] == "cancelled"  # as saved on disk too


async def test_a_batch_model_is_a_string_or_none(tmp_path: Path) -> None:
    """The batch's `model` (OpenAI's: a string) came from its first line's body as it was: a
    line's `model: 5` (the endpoint's 400) made the batch object's `model` the number 5."""
    files = FileStore(tmp_path)
    data = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": model, "prompt": "p"}}) + "\n"
                   for i, model in enumerate([5, "m"])).encode()
    file_id = files.create(io.BytesIO(data), "in.jsonl", "batch")["id"]
    runner = BatchRunner(tmp_path, files, Endpoint().app, concurrency=1)
    await runner.start()
    batch = await _finish(runner, runner.create(file_id, "/v1/completions", "24h", None))
    await runner.shutdown()
    assert batch["status"] == "completed"
    assert batch["model"] is None  # was 5


async def test_an_input_kept_by_a_copy_where_links_fail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the folder takes no hard links, the batch keeps a copy of its input (removed
    when it ends); a copy that fails (a full disk) fails the create and leaves nothing
    behind: its partial copy stayed in `batches/` for good."""
    def no_links(source: Any, target: Any) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(batch_runner.os, "link", no_links)
    runner, file_id = _runner(tmp_path, Endpoint())
    await runner.start()
    batch = runner.create(file_id, "/v1/completions", "24h", None)
    runner.files.delete(file_id)
    batch = await _finish(runner, batch)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [f"{batch['id']}.json"]

    file_id = runner.files.create(io.BytesIO(b'{"custom_id": "a"}\n'), "in.jsonl",
                                  "batch")["id"]

    def disk_full(source: Any, target: Any) -> None:
        Path(target).write_bytes(b'{"cust')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(batch_runner.shutil, "copyfile", disk_full)
    with pytest.raises(OSError):
        runner.create(file_id, "/v1/completions", "24h", None)
    await runner.shutdown()
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [f"{batch['id']}.json"]
