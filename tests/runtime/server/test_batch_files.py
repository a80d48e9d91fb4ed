"""The replica's /v1/files routes in process (no model): the upload limit's 413, and file
content by id. The Batch API end to end runs on real servers in test_batch_api.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from argosy_runtime.server.batch.batch_runner import BatchRunner
from argosy_runtime.server.batch.file_store import FileStore
from argosy_runtime.server.batch.routes import add_batch_routes
from argosy_runtime.server.body_limit import BodySizeLimitMiddleware
from argosy_runtime.server.errors import install_error_handlers
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

LIMIT = 4096  # the store's upload limit here (a replica's is MAX_FILE_BYTES)


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path, max_bytes=LIMIT)


@pytest.fixture
async def client(tmp_path: Path, store: FileStore) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    install_error_handlers(app)
    add_batch_routes(app, store, BatchRunner(tmp_path, store, app, concurrency=1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://replica") as c:
        yield c


async def _upload(client: httpx.AsyncClient, data: bytes) -> httpx.Response:
    return await client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("in.jsonl", data, "application/jsonl")})


async def test_an_upload_over_the_limit_is_a_413_naming_the_limit(
        client: httpx.AsyncClient, store: FileStore) -> None:
    at_limit = await _upload(client, b"x" * LIMIT)
    assert at_limit.status_code == 200 and at_limit.json()["bytes"] == LIMIT

    over = await _upload(client, b"x" * (LIMIT + 1))
    assert over.status_code == 413
    error = over.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "file", "file_too_large")
    assert f"upload limit of {LIMIT} bytes" in error["message"]
    assert [f["id"] for f in store.list()] == [at_limit.json()["id"]]  # nothing half-stored
    assert not list(store.dir.glob(".*.part"))


async def test_an_upload_far_over_the_limit_is_refused_before_it_is_spooled_whole(
        tmp_path: Path, store: FileStore) -> None:
    """The form (its file spooled to a temporary file) is parsed before the route can check
    the size: a 413 only then let a client fill the disk with one upload of any size. The
    server's middleware cuts an upload off at the file limit plus the form's room, whether
    its size is announced or not, with the store's own 413, and stores nothing."""
    app = FastAPI()
    install_error_handlers(app)
    add_batch_routes(app, store, BatchRunner(tmp_path, store, app, concurrency=1))
    read = 0

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            return message
        await app(scope, counted, send)

    limited = BodySizeLimitMiddleware(counting, max_bytes=16 << 20, upload_max_bytes=LIMIT)
    head = (b'--B\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--B\r\ncontent-disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            b'content-type: application/jsonl\r\n\r\n')
    chunk, chunks = b"x" * (1 << 20), 64  # 64 MiB, far over the 4 KiB limit

    async def body():  # noqa: ANN202 (chunked: no content-length)
        yield head
        for _ in range(chunks):
            yield chunk
        yield b"\r\n--B--\r\n"

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=limited),
                                 base_url="http://replica") as client:
        headers = {"content-type": "multipart/form-data; boundary=B"}
        refused = await client.post("/v1/files", content=body(), headers=headers)
        announced = await client.post("/v1/files", headers=headers,
                                      content=head + chunk * 4 + b"\r\n--B--\r\n")
        fits = await _upload(client, b"x" * LIMIT)  # the limit itself still passes
    assert refused.status_code == announced.status_code == 413, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "file", "file_too_large")
    assert f"upload limit of {LIMIT} bytes" in error["message"]
    assert announced.json() == refused.json()
    assert read - LIMIT < 3 * len(chunk)  # never the whole 64 MiB (nor the announced 4)
    assert fits.status_code == 200, fits.text
    assert [f["id"] for f in store.list()] == [fits.json()["id"]]


async def test_content_by_id_and_unknown_or_crafted_ids_are_404(
        client: httpx.AsyncClient, store: FileStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b'{"custom_id": "a"}\n'
    file_id = (await _upload(client, data)).json()["id"]
    reads: list[str] = []
    get = store.get
    monkeypatch.setattr(store, "get", lambda i, owner=None: reads.append(i) or get(i, owner))
    content = await client.get(f"/v1/files/{file_id}/content")
    assert content.status_code == 200 and content.content == data
    assert reads == [file_id]  # the metadata is read once
    assert 'filename="in.jsonl"' in content.headers["content-disposition"]
    for bad in ("file-0123456789abcdef", "file-..%2Ffiles%2F" + file_id[5:], "..%2Fbatches"):
        missing = await client.get(f"/v1/files/{bad}/content")
        assert missing.status_code == 404, bad
        assert missing.json()["error"]["type"] == "not_found_error"


async def test_a_download_racing_a_delete_is_a_404_or_the_whole_file(
        client: httpx.AsyncClient, store: FileStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete (this replica's or another's) may land between a download's metadata read
    and its bytes: that is a 404, not a 500 (a late stat of a path that is gone). A delete
    after the download opened the file leaves it the whole file (the open handle reads on)."""
    data = b'{"custom_id": "a"}\n' * 100
    get = store.get

    def get_then_deleted(file_id: str, owner: str | None = None) -> dict:
        meta = get(file_id, owner)
        monkeypatch.setattr(store, "get", get)  # the delete's own read is a plain one
        store.delete(file_id)
        return meta

    file_id = (await _upload(client, data)).json()["id"]
    monkeypatch.setattr(store, "get", get_then_deleted)
    gone = await client.get(f"/v1/files/{file_id}/content")
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == "file_not_found"

    file_id = (await _upload(client, data)).json()["id"]
    open_file = store.open

    def opened_then_deleted(file_id: str, owner: str | None = None):  # noqa: ANN202
        opened = open_file(file_id, owner)
        store.delete(file_id)
        return opened

    monkeypatch.setattr(store, "open", opened_then_deleted)
    whole = await client.get(f"/v1/files/{file_id}/content")
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["content-length"] == str(len(data))
    assert 'filename="in.jsonl"' in whole.headers["content-disposition"]
    assert (await client.get(f"/v1/files/{file_id}")).status_code == 404  # it was deleted


async def test_of_two_racing_deletes_one_deletes_and_the_other_is_a_404(
        client: httpx.AsyncClient, store: FileStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas share the folder: two deletes of one file (two clients, or a retry through
    another replica) may both pass the existence check. Only one of them deleted it: the
    other is the 404 it would have been a moment later (both answered deleted: true)."""
    file_id = (await _upload(client, b'{"custom_id": "a"}\n')).json()["id"]
    get = store.get

    def get_then_deleted_by_the_other(file_id: str, owner: str | None = None) -> dict:
        meta = get(file_id, owner)
        monkeypatch.setattr(store, "get", get)
        store.delete(file_id)  # the other delete, after this one's check
        return meta

    monkeypatch.setattr(store, "get", get_then_deleted_by_the_other)
    late = await client.delete(f"/v1/files/{file_id}")
    assert late.status_code == 404, late.text
    assert late.json()["error"]["code"] == "file_not_found"
    assert not list(store.dir.glob(f"{file_id}*"))


async def test_a_file_deleted_between_listing_and_reading_is_skipped_not_a_500(
        client: httpx.AsyncClient, store: FileStore) -> None:
    """Replicas share the folder: another one may delete a file after this one listed the
    folder and before it read the metadata. A dangling link plays that: listed, then gone."""
    kept = (await _upload(client, b'{"custom_id": "a"}\n')).json()["id"]
    gone = "file-" + "0" * 32
    (store.dir / f"{gone}.json").symlink_to(store.dir / "deleted-meanwhile.json")
    listed = await client.get("/v1/files")
    assert listed.status_code == 200
    assert [f["id"] for f in listed.json()["data"]] == [kept]
    missing = await client.get(f"/v1/files/{gone}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"


def _as(owner: str) -> dict[str, str]:
    return {"X-Argosy-Owner": owner}


async def test_an_owner_sees_only_its_own_and_unowned_objects(
        client: httpx.AsyncClient, store: FileStore) -> None:
    """What a gateway with tenants sends (X-Argosy-Owner): objects are recorded as the
    owner's, and another owner's id is the same 404 as an unknown one. A request without the
    header (an open gateway, a direct call with the replica's key) sees everything; an object
    stored before owners were recorded stays visible to every owner."""
    data = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    mine = (await client.post("/v1/files", data={"purpose": "batch"}, headers=_as("a"),
                              files={"file": ("in.jsonl", data)})).json()
    assert "owner" not in mine
    unowned = (await _upload(client, data)).json()["id"]
    batch = await client.post("/v1/batches", headers=_as("a"), json={
        "input_file_id": mine["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert batch.status_code == 200 and "owner" not in batch.json()
    batch_id = batch.json()["id"]

    async def ids(kind: str, headers: dict[str, str]) -> set[str]:
        return {item["id"] for item in (await client.get(f"/v1/{kind}", headers=headers)
                                        ).json()["data"]}

    assert await ids("files", _as("b")) == {unowned}
    assert await ids("files", _as("a")) == await ids("files", {}) == {mine["id"], unowned}
    assert await ids("batches", _as("b")) == set()
    assert await ids("batches", _as("a")) == await ids("batches", {}) == {batch_id}
    unknown = await client.get("/v1/files/file-" + "0" * 32, headers=_as("b"))
    for method, path, code in (("GET", f"/v1/files/{mine['id']}", "file_not_found"),
                               ("GET", f"/v1/files/{mine['id']}/content", "file_not_found"),
                               ("DELETE", f"/v1/files/{mine['id']}", "file_not_found"),
                               ("GET", f"/v1/batches/{batch_id}", "batch_not_found"),
                               ("POST", f"/v1/batches/{batch_id}/cancel", "batch_not_found")):
        other = await client.request(method, path, headers=_as("b"))
        assert other.status_code == 404, (method, path)
        assert other.json()["error"]["code"] == code
        if code == "file_not_found":  # word for word an unknown id's answer, but the id
            assert other.json()["error"]["message"] == unknown.json()["error"]["message"] \
                .replace("file-" + "0" * 32, mine["id"])
    reuse = await client.post("/v1/batches", headers=_as("b"), json={
        "input_file_id": mine["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert reuse.status_code == 404
    assert (await client.get(f"/v1/files/{unowned}", headers=_as("b"))).status_code == 200
    assert (await client.get(f"/v1/batches/{batch_id}", headers=_as("a"))).status_code == 200
    assert (await client.get(f"/v1/files/{mine['id']}/content")).content == data
    assert (await client.delete(f"/v1/files/{mine['id']}", headers=_as("a"))).status_code == 200


async def test_batch_create_names_its_fields_in_errors(client: httpx.AsyncClient) -> None:
    """An unknown input file is a 404 naming `input_file_id` (the create's field, not the
    store's `file_id`); metadata keys and values over OpenAI's 64 and 512 characters are a 400
    (they were stored, at any size, on every batch record)."""
    body = {"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/completions",
            "completion_window": "24h"}
    missing = await client.post("/v1/batches", json=body)
    assert missing.status_code == 404
    assert (missing.json()["error"]["param"], missing.json()["error"]["code"]) == (
        "input_file_id", "file_not_found")
    body["input_file_id"] = (await _upload(client, b'{"custom_id": "a"}\n')).json()["id"]
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
        refused = await client.post("/v1/batches", json={**body, "metadata": metadata})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "metadata"
    fits = await client.post("/v1/batches", json={**body, "metadata": {"k" * 64: "v" * 512}})
    assert fits.status_code == 200, fits.text
    assert fits.json()["metadata"] == {"k" * 64: "v" * 512}


async def test_files_list_newest_first_even_within_one_second(
        client: httpx.AsyncClient) -> None:
    """`created_at` counts seconds: files uploaded in the same second were ordered by their
    random ids, so `files.list(limit=1)` could miss the newest upload."""
    ids = [(await _upload(client, b'{"custom_id": "a"}\n')).json()["id"] for _ in range(6)]
    newest_first = await client.get("/v1/files")
    assert [f["id"] for f in newest_first.json()["data"]] == ids[::-1]
    oldest_first = await client.get("/v1/files", params={"order": "asc"})
    assert [f["id"] for f in oldest_first.json()["data"]] == ids


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_deleting_each_page_while_paginating_reaches_every_file(
        client: httpx.AsyncClient, order: str) -> None:
    """The official client's auto-pagination asks for `after=<last id of the page>`: deleting
    the files of each page as it comes (a "delete all my files" loop) made that cursor
    unknown, and the next page came back empty, leaving the rest of the files behind."""
    for _ in range(5):
        await _upload(client, b'{"custom_id": "a"}\n')
    after: str | None = None
    deleted = 0
    while True:
        params = {"limit": 2, "order": order, **({"after": after} if after else {})}
        listed = (await client.get("/v1/files", params=params)).json()
        for f in listed["data"]:
            assert (await client.delete(f"/v1/files/{f['id']}")).json()["deleted"]
            deleted += 1
        if not listed["has_more"]:
            break
        after = listed["last_id"]
    assert deleted == 5
    assert (await client.get("/v1/files")).json()["data"] == []
