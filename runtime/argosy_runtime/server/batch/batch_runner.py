"""Runs batches: each request of the input file goes through this server's own HTTP handlers
(in process, over ASGI), so a batch answer is exactly what the live endpoint would answer.

Requests run at a lower scheduling priority than live traffic (`priority` 1 unless a line
sets its own), at most `concurrency` at a time across all batches, so a batch keeps the
running batch full without flooding the waiting queue. A 429 or a 503 is retried; while the
server drains, a batch stops taking new requests and stays `in_progress` on disk: started
again on the same `--batch-dir`, it resumes with the requests not yet in its result files.

Status moves validating -> in_progress -> finalizing -> completed, or to failed (the input
file is unusable), cancelling -> cancelled, or expired (24 h after creation: the requests
left go to the error file as `batch_expired`).

Several replicas may share one `--batch-dir`. Each sees every file and batch; a batch runs on
the one replica holding its lock (batch_lock.py), and every `scan_interval_s` each replica
that is not draining takes over the unfinished batches nobody holds: those of a replica that
drained, crashed or was scaled away. Each scan also deletes the files past their
`expires_at`. A batch's record on disk is written by its runner only (status changes, and its
counts at most once per SAVE_INTERVAL_S); a cancel that reaches another replica leaves a
`<id>.cancel` marker that the runner acts on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import httpx
from argosy_runtime.server.batch.batch_input import ENDPOINTS, BatchLine, read_batch_input
from argosy_runtime.server.batch.batch_lock import BatchLock
from argosy_runtime.server.batch.batch_results import BatchResults
from argosy_runtime.server.batch.file_store import (
    FileStore,
    list_key,
    new_id,
    read_json_record,
    record_path,
    write_json_atomic,
)
from argosy_runtime.server.errors import APIError
from argosy_runtime.server.owners import OWNER_HEADER, visible_to
from starlette.types import ASGIApp

logger = logging.getLogger("argosy.batch")

BATCH_PRIORITY = 1  # live requests default to 0: lower runs first
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
RETRY_STATUSES = (429, 503)  # the server is full or briefly unavailable: not the request's fault
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
SCAN_INTERVAL_S = 5.0  # how often a replica looks for unfinished batches nobody runs
SAVE_INTERVAL_S = 1.0  # how stale the counts other replicas read may be


class BatchRunner:
    def __init__(self, root: Path, files: FileStore, app: ASGIApp, *, concurrency: int,
                 api_key: str | None = None,
                 is_draining: Callable[[], bool] = lambda: False,
                 scan_interval_s: float = SCAN_INTERVAL_S) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = files
        self.app = app
        self.concurrency = concurrency
        self.api_key = api_key
        self.is_draining = is_draining
        self.scan_interval_s = scan_interval_s
        self.batches: dict[str, dict[str, Any]] = {}  # the ones this runner runs
        self._finished: set[str] = set()  # seen done for good: the scans read them no more
        self._locks: dict[str, BatchLock] = {}
        self._saved_at: dict[str, float] = {}
        self._scanner: asyncio.Task[None] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._in_flight: dict[str, set[asyncio.Task[None]]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._transport: httpx.ASGITransport | None = None

    # ---- lifecycle (inside the server's event loop) ----------------------------------------
    async def start(self) -> None:
        """Resume the unfinished batches on disk that nobody runs, and keep looking."""
        self._slots = asyncio.Semaphore(self.concurrency)
        self._transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        self._take_over_orphans()
        self._scanner = asyncio.get_running_loop().create_task(self._scan_forever())

    async def shutdown(self) -> None:
        """Stop every batch where it is; unfinished ones stay resumable on disk (by this
        replica's successor, or by another one sharing the folder)."""
        if self._scanner is not None:
            self._scanner.cancel()
        for task in self._tasks.values():
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(BaseException):
                await task
        if self._transport is not None:
            await self._transport.aclose()

    # ---- the API ---------------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None, owner: str | None = None,
               output_expires_after_s: int | None = None) -> dict[str, Any]:
        """A new batch of `owner`'s (owners.py), from an input file `owner` may see; its
        output and error files expire `output_expires_after_s` seconds after they are
        written (None: kept until deleted)."""
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, "
                                f"got {endpoint!r}", param="endpoint")
        if completion_window not in COMPLETION_WINDOW_S:
            raise APIError(400, f"completion_window must be '24h', got {completion_window!r}",
                           param="completion_window")
        try:
            meta = self.files.get(input_file_id, owner)
        except APIError:  # the store's 404 names its own `file_id`; here it is this
            raise _no_input_file(input_file_id) from None
        if meta["purpose"] != "batch":
            raise APIError(400, f"file {input_file_id!r} has purpose {meta['purpose']!r}, "
                                "not 'batch'", param="input_file_id")
        batch_id, created = new_id("batch_")  # ids sort in creation order (file_store.py)
        batch = {
            "id": batch_id, "object": "batch", "endpoint": endpoint,
            "errors": None, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created,
            "in_progress_at": None, "expires_at": created + COMPLETION_WINDOW_S[completion_window],
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata, "model": None, "usage": None,
            "owner": owner,  # not shown to clients (owners.public); owns its output files
            # the request's output_expires_after.seconds; not part of OpenAI's Batch object
            # (routes.py leaves it out)
            "output_expires_after_s": output_expires_after_s,
        }
        lock = BatchLock.try_acquire(self.dir / f"{batch['id']}.lock")
        assert lock is not None  # a fresh id: nobody else can hold it
        try:
            self._keep_input(batch["id"], input_file_id)
            self._save(batch)
        except BaseException:  # nothing left behind: no lock, no (partial) copy, no record
            lock.release()
            (self.dir / f"{batch['id']}.lock").unlink(missing_ok=True)
            self._input_path(batch["id"]).unlink(missing_ok=True)
            raise
        self._own(batch, lock)
        logger.info("created %s from %s for %s", batch["id"], input_file_id, endpoint)
        return batch

    def _input_path(self, batch_id: str) -> Path:
        return self.dir / f"{batch_id}.input.jsonl"

    def _keep_input(self, batch_id: str, input_file_id: str) -> None:
        """The batch's own hold on its input's bytes (a hard link, else a copy) until it
        ends: the client may delete the input file meanwhile (OpenAI allows it), and a batch
        resumed after a restart, or taken over by another replica, reads its input again."""
        target = self._input_path(batch_id)
        try:
            source = self.files.content_path(input_file_id)
            os.link(source, target)
        except (APIError, FileNotFoundError):  # deleted since its metadata was read
            raise _no_input_file(input_file_id) from None
        except OSError:  # links not supported here
            shutil.copyfile(source, target)

    def get(self, batch_id: str, owner: str | None = None) -> dict[str, Any]:
        """The batch's record (this runner's live one when it runs it), `cancelling` once a
        cancel is left for its runner; 404 for an unknown id and for another owner's batch
        alike."""
        batch = self.batches.get(batch_id) or read_json_record(self._record_path(batch_id))
        if batch is None or not visible_to(batch.get("owner"), owner):
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id",
                           code="batch_not_found")
        return self._with_pending_cancel(batch)

    def _with_pending_cancel(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as its runner will show it once it acts on a cancel left by another
        replica (within a scan): a client told `cancelling` must not see it `in_progress`
        again on its next retrieve."""
        if batch["status"] not in ("validating", "in_progress"):
            return batch
        try:
            cancelled_at = self._cancel_marker(batch["id"]).stat().st_mtime
        except FileNotFoundError:
            return batch
        return {**batch, "status": "cancelling", "cancelling_at": int(cancelled_at)}

    def list(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every batch in the folder `owner` may see, newest first (this runner's own from
        memory)."""
        found = {}
        for path in self.dir.glob("batch_*.json"):
            batch = read_json_record(path)
            if batch is not None:
                found[batch["id"]] = batch
        found.update(self.batches)
        return sorted((self._with_pending_cancel(b) for b in found.values()
                       if visible_to(b.get("owner"), owner)), key=list_key, reverse=True)

    def num_pending(self) -> int:
        """Requests of unfinished batches not answered yet (a gauge)."""
        return sum(b["request_counts"]["total"] - b["request_counts"]["completed"]
                   - b["request_counts"]["failed"]
                   for b in self.batches.values() if b["status"] in ACTIVE)

    def cancel(self, batch_id: str, owner: str | None = None) -> dict[str, Any]:
        batch = self.get(batch_id, owner)
        if batch["status"] == "cancelling":
            return batch  # cancelled twice: the same answer as the first time
        if batch["status"] not in ("validating", "in_progress"):
            raise APIError(409, f"batch {batch_id} is {batch['status']}; only a validating or "
                                "in_progress batch can be cancelled", code="batch_not_active")
        if batch_id not in self.batches:
            # Another replica runs it (or will): leave it the word, answer as it will.
            self._cancel_marker(batch_id).touch()
            return self._with_pending_cancel(batch)
        self._start_cancelling(batch)
        return batch

    def _start_cancelling(self, batch: dict[str, Any]) -> None:
        self._set_status(batch, "cancelling")
        for task in self._in_flight.get(batch["id"], ()):
            task.cancel()  # its request is aborted and stays out of the result files

    # ---- ownership when replicas share the folder -----------------------------------------
    async def _scan_forever(self) -> None:
        while True:
            await asyncio.sleep(self.scan_interval_s)
            try:
                for batch in list(self.batches.values()):
                    self._honour_cancel_marker(batch)
                self._take_over_orphans()
                if expired := self.files.delete_expired():
                    logger.info("deleted %d expired file(s) from %s", expired, self.files.dir)
            except Exception:  # a bad file must not stop the scans for good
                logger.exception("scanning %s for batches failed", self.dir)

    def _take_over_orphans(self) -> None:
        """Run the unfinished batches whose lock is free (none while this server drains)."""
        for path in sorted(self.dir.glob("batch_*.json")):
            if self.is_draining():
                return
            batch_id = path.name.removesuffix(".json")
            if (batch_id in self.batches or batch_id in self._finished
                    or not self._unfinished(read_json_record(path))):
                continue
            lock = BatchLock.try_acquire(self.dir / f"{batch_id}.lock")
            if lock is None:
                continue  # another replica runs it
            batch = read_json_record(path)  # as its last runner left it
            if not self._unfinished(batch):
                lock.release()
                continue
            logger.info("resuming %s (%s)", batch_id, batch["status"])
            self._own(batch, lock)

    def _unfinished(self, batch: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
        """Is this record an unfinished batch? A finished one never runs again: the scans
        skip it from now on instead of reading it every time."""
        if batch is None:
            return False
        if batch["status"] in ACTIVE:
            return True
        self._finished.add(batch["id"])
        return False

    def _own(self, batch: dict[str, Any], lock: BatchLock) -> None:
        batch_id = batch["id"]
        self.batches[batch_id] = batch
        self._locks[batch_id] = lock

        def release(_: asyncio.Task[None]) -> None:
            # Finished, drained or cancelled by shutdown: from now on another runner may
            # take it (only an unfinished one will).
            self.batches.pop(batch_id, None)
            self._saved_at.pop(batch_id, None)
            if batch["status"] not in ACTIVE:  # done for good: nobody needs these again
                (self.dir / f"{batch_id}.lock").unlink(missing_ok=True)
                self._cancel_marker(batch_id).unlink(missing_ok=True)
                self._input_path(batch_id).unlink(missing_ok=True)
            self._locks.pop(batch_id).release()

        self._launch(batch)
        self._tasks[batch_id].add_done_callback(release)

    def _cancel_marker(self, batch_id: str) -> Path:
        return self.dir / f"{batch_id}.cancel"

    def _honour_cancel_marker(self, batch: dict[str, Any]) -> None:
        if batch["status"] in ("validating", "in_progress") and \
                self._cancel_marker(batch["id"]).exists():
            self._start_cancelling(batch)

    def _record_path(self, batch_id: str) -> Path:
        return record_path(self.dir, batch_id, "batch_")

    # ---- running one batch -----------------------------------------------------------------
    def _launch(self, batch: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._run_guarded(batch))
        self._tasks[batch["id"]] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch["id"], None))

    async def _run_guarded(self, batch: dict[str, Any]) -> None:
        """A batch that breaks (a full disk, a bug) fails visibly instead of staying
        in_progress with nobody running it."""
        try:
            await self._run(batch)
        except Exception as exc:
            logger.exception("%s failed", batch["id"])
            batch["errors"] = {"object": "list", "data": [
                {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}",
                 "line": None, "param": None}]}
            try:  # the answers it had are the user's: published, not left in the folder
                self._publish_results(batch, BatchResults.open(self.dir, batch["id"]))
            except Exception:  # the disk that broke the batch may refuse this too
                logger.exception("%s: its results could not be published", batch["id"])
            self._set_status(batch, "failed")
            self._remove_results(batch["id"])

    async def _run(self, batch: dict[str, Any]) -> None:
        self._honour_cancel_marker(batch)
        try:
            path = self._input_path(batch["id"])
            if not path.exists():  # a batch recorded before batches kept their input
                path = self.files.content_path(batch["input_file_id"])
            lines, errors = await asyncio.to_thread(read_batch_input, path, batch["endpoint"])
        except (APIError, FileNotFoundError) as exc:
            # The input file was deleted before the batch started (FileNotFoundError: after
            # its metadata was read, by this replica or another).
            message = exc.message if isinstance(exc, APIError) else \
                f"no file with id {batch['input_file_id']!r}"
            lines, errors = [], [{"code": "file_not_found", "message": message,
                                  "line": None, "param": "input_file_id"}]
        if errors:
            batch["errors"] = {"object": "list", "data": errors}
            # Cancelled while validating (here or through another replica's marker): the
            # client was answered `cancelling`, which ends `cancelled` as on OpenAI's; the
            # errors found stay listed.
            self._honour_cancel_marker(batch)
            self._set_status(batch, "cancelled" if batch["status"] == "cancelling" else "failed")
            logger.warning("%s failed validation: %s", batch["id"], errors[0]["message"])
            return
        results = BatchResults.open(self.dir, batch["id"])
        batch["request_counts"]["total"] = len(lines)
        model = lines[0].body.get("model")  # the endpoint's 400 when it is no string
        batch["model"] = model if isinstance(model, str) else None
        if batch["status"] == "validating":
            self._set_status(batch, "in_progress")
        await self._dispatch(batch, [ln for ln in lines if ln.custom_id not in results.done],
                             results)
        if batch["status"] == "in_progress" and self.is_draining():
            return  # resumes from its result files on the next start
        if batch["status"] != "cancelling" and time.time() >= batch["expires_at"]:
            for line in lines:
                if line.custom_id not in results.done:
                    results.add_expired(line.custom_id)
        self._finalize(batch, results)

    async def _dispatch(self, batch: dict[str, Any], pending: list[BatchLine],
                        results: BatchResults) -> None:
        assert self._slots is not None
        in_flight = self._in_flight.setdefault(batch["id"], set())
        # A request whose result could not be recorded (a full disk, a bug) fails the batch
        # (`_run_guarded`): left alone, it would be missing from a batch that completes.
        broken: list[BaseException] = []

        def settle(task: asyncio.Task[None]) -> None:
            in_flight.discard(task)
            self._slots.release()  # type: ignore[union-attr]
            if not task.cancelled() and task.exception() is not None:
                broken.append(task.exception())  # type: ignore[arg-type]

        self._update_counts(batch, results)
        try:
            for line in pending:
                await self._slots.acquire()
                self._honour_cancel_marker(batch)
                if broken or not self._should_continue(batch):
                    self._slots.release()
                    break
                task = asyncio.create_task(self._run_line(batch, line, results))
                in_flight.add(task)
                task.add_done_callback(settle)
            await asyncio.gather(*in_flight, return_exceptions=True)
        finally:
            for task in in_flight:
                task.cancel()
            self._in_flight.pop(batch["id"], None)
        if broken:
            raise broken[0]

    def _should_continue(self, batch: dict[str, Any]) -> bool:
        return (batch["status"] == "in_progress" and not self.is_draining()
                and time.time() < batch["expires_at"])

    async def _run_line(self, batch: dict[str, Any], line: BatchLine,
                        results: BatchResults) -> None:
        body = {"priority": BATCH_PRIORITY, **line.body}
        if batch["endpoint"] == "/v1/responses":
            body.setdefault("store", False)  # the answer is in the output file; keep no copy
        request_id = f"{batch['id']}-{line.number}"
        delay = 0.25
        while True:
            response = await self._post(batch["endpoint"], body, request_id, batch.get("owner"))
            if response.status_code not in RETRY_STATUSES:
                break
            if not self._should_continue(batch):
                return  # not the request's fault: it stays pending
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        payload = _json_or_error(response)
        if response.status_code == 200 and _was_aborted(payload):
            return  # cut short by a drain or cancel: it runs again on resume
        results.add(line.custom_id, response.status_code, request_id, payload)
        self._update_counts(batch, results)

    async def _post(self, path: str, body: dict[str, Any], request_id: str,
                    owner: str | None) -> httpx.Response:
        """POST to this server's own handler, in process. Sent through the ASGI transport
        itself, not an httpx.AsyncClient: the client logs every request at INFO on the
        process-wide `httpx` logger, a second line beside the access log's, and quieting that
        logger would quiet every other httpx client in the process too."""
        assert self._transport is not None
        headers = {"x-request-id": request_id}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        if owner is not None:  # a line's previous_response_id may name only the owner's
            headers[OWNER_HEADER] = owner  # responses, and what it stores is the owner's
        request = httpx.Request("POST", f"http://batch.internal{path}", json=body,
                                headers=headers)
        response = await self._transport.handle_async_request(request)
        await response.aread()
        return response

    def _finalize(self, batch: dict[str, Any], results: BatchResults) -> None:
        if batch["status"] == "cancelling":
            final = "cancelled"
        elif time.time() >= batch["expires_at"]:
            final = "expired"
        else:
            final = "completed"
        if final != "cancelled":  # a cancel goes cancelling -> cancelled, as OpenAI's does
            self._set_status(batch, "finalizing")
        self._publish_results(batch, results)
        self._set_status(batch, final)
        self._remove_results(batch["id"])  # only now: until here a resume reads them
        counts = batch["request_counts"]
        logger.info("%s %s: %d completed, %d failed of %d", batch["id"], final,
                    counts["completed"], counts["failed"], counts["total"])

    def _publish_results(self, batch: dict[str, Any], results: BatchResults) -> None:
        """The result files into the file store as the batch's output and error files, with
        the counts and token usage they hold."""
        self._update_counts(batch, results)
        batch["usage"] = results.usage()
        for key, path, name in (("output_file_id", results.output_path, "output"),
                                ("error_file_id", results.error_path, "errors")):
            if path.is_file() and path.stat().st_size:
                # An id fixed by the batch: finalizing again after a crash replaces the file.
                file_id = f"file-{uuid.uuid5(uuid.NAMESPACE_URL, batch['id'] + name).hex}"
                batch[key] = self.files.adopt(path, f"{batch['id']}_{name}.jsonl",
                                              file_id, batch.get("owner"),
                                              batch.get("output_expires_after_s"))["id"]

    def _remove_results(self, batch_id: str) -> None:
        for path in BatchResults.paths(self.dir, batch_id):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                path.unlink()

    def _update_counts(self, batch: dict[str, Any], results: BatchResults) -> None:
        batch["request_counts"].update(completed=results.completed, failed=results.failed)
        if time.monotonic() - self._saved_at.get(batch["id"], 0.0) >= SAVE_INTERVAL_S:
            self._save(batch)  # what the other replicas answer for it

    def _set_status(self, batch: dict[str, Any], status: str) -> None:
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        self._save(batch)

    def _save(self, batch: dict[str, Any]) -> None:
        write_json_atomic(self.dir / f"{batch['id']}.json", batch)
        self._saved_at[batch["id"]] = time.monotonic()


def _json_or_error(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return {"error": {"message": response.text[:1000] or f"HTTP {response.status_code}",
                      "type": "server_error", "param": None, "code": None}}


def _was_aborted(body: dict[str, Any]) -> bool:
    """Cut short by a drain or cancel: a chat/completion choice ending in `abort`, or a
    Response that failed for it (responses/response_object.py)."""
    if body.get("object") == "response":
        return body.get("status") == "failed"
    return any(c.get("finish_reason") == "abort" for c in body.get("choices") or ())


def _no_input_file(input_file_id: str) -> APIError:
    """The file store's 404, naming the batch's field."""
    return APIError(404, f"no file with id {input_file_id!r}", param="input_file_id",
                    code="file_not_found")
