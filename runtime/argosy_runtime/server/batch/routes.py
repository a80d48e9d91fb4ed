"""The Batch API routes: `/v1/files` and `/v1/batches`, shaped like OpenAI's so the official
client's `files` and `batches` resources work unchanged. A request naming an owner (a gateway
tenant's, owners.py) creates that owner's objects and sees only those; the `owner` the
stores record is not part of the objects clients get (`public`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any, BinaryIO, Literal
from urllib.parse import quote

from argosy_runtime.server.batch.batch_runner import BatchRunner
from argosy_runtime.server.batch.file_store import FileStore, cursor_key
from argosy_runtime.server.batch.pagination import page
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.owners import Owner, public
from fastapi import FastAPI, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# OpenAI's metadata limits: 16 pairs, keys of at most 64 characters, values of at most 512.
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


# OpenAI's bounds on a file's lifetime: 1 hour to 30 days after its creation.
ExpirySeconds = Annotated[int, Field(ge=3600, le=30 * 24 * 3600)]


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file (an upload's `expires_after`, a batch's
    `output_expires_after` for the files it writes), anchored at the file's creation."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: ExpirySeconds


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


def add_batch_routes(app: FastAPI, files: FileStore, runner: BatchRunner) -> None:
    @app.post("/v1/files")
    async def upload_file(
            file: Annotated[UploadFile, File()],
            purpose: Annotated[str, Form()],
            # the official client sends `expires_after` as these two form fields
            expires_anchor: Annotated[Literal["created_at"] | None,
                                      Form(alias="expires_after[anchor]")] = None,
            expires_seconds: Annotated[ExpirySeconds | None,
                                       Form(alias="expires_after[seconds]")] = None,
            owner: Owner = None) -> dict[str, Any]:
        if (expires_anchor is None) != (expires_seconds is None):
            raise bad_request("expires_after: needs both anchor and seconds", "expires_after")
        return public(await asyncio.to_thread(files.create, file.file,
                                              file.filename or "upload.jsonl", purpose, owner,
                                              expires_seconds))

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, after: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                         order: Literal["asc", "desc"] = "desc",
                         owner: Owner = None) -> dict[str, Any]:
        items = [public(f) for f in files.list(purpose, owner)]
        return page(items if order == "desc" else items[::-1], after, limit,
                    after_key=cursor_key(after, "file-") if after else None,
                    descending=order == "desc")

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, owner: Owner = None) -> dict[str, Any]:
        return public(files.get(file_id, owner))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, owner: Owner = None) -> StreamingResponse:
        # Opened before answering, and streamed from the handle: a delete racing the
        # download is a 404 (not yet open) or the whole file (open), never a 500 from a
        # late look at a path that is gone (what FileResponse does).
        f, meta = await asyncio.to_thread(files.open, file_id, owner)
        size = os.fstat(f.fileno()).st_size
        return StreamingResponse(
            _read_chunks(f), media_type="application/jsonl",
            headers={"content-length": str(size),
                     "content-disposition": _attachment(meta["filename"])})

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, owner: Owner = None) -> dict[str, Any]:
        return files.delete(file_id, owner)

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest, owner: Owner = None) -> dict[str, Any]:
        expiry = body.output_expires_after
        return _batch_object(runner.create(body.input_file_id, body.endpoint,
                                           body.completion_window, body.metadata, owner,
                                           None if expiry is None else expiry.seconds))

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           owner: Owner = None) -> dict[str, Any]:
        return page([_batch_object(b) for b in runner.list(owner)], after, limit,
                    after_key=cursor_key(after, "batch_") if after else None)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, owner: Owner = None) -> dict[str, Any]:
        return _batch_object(runner.get(batch_id, owner))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, owner: Owner = None) -> dict[str, Any]:
        return _batch_object(runner.cancel(batch_id, owner))


def _batch_object(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch record as OpenAI's Batch object (without the runner's own fields)."""
    shown = public(batch)
    shown.pop("output_expires_after_s", None)
    return shown


async def _read_chunks(f: BinaryIO) -> AsyncIterator[bytes]:
    """The open file's bytes, read off the event loop, closed at the end (or when the client
    goes away)."""
    try:
        while chunk := await asyncio.to_thread(f.read, 1 << 20):
            yield chunk
    finally:
        f.close()


def _attachment(filename: str) -> str:
    """The Content-Disposition header FileResponse would send for `filename`."""
    quoted = quote(filename)
    if quoted != filename:
        return f"attachment; filename*=utf-8''{quoted}"
    return f'attachment; filename="{filename}"'
