"""File expiry on the Batch API, through the official `openai` client in process (no model):
an upload's `expires_after` and a batch's `output_expires_after`, as OpenAI defines them
(anchored at the file's creation, 3600 s to 30 days)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from argosy_runtime.server.batch.batch_runner import BatchRunner
from argosy_runtime.server.batch.file_store import FileStore
from argosy_runtime.server.batch.routes import add_batch_routes
from argosy_runtime.server.errors import install_error_handlers
from fastapi import FastAPI
from starlette.requests import Request

LINES = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"prompt": f"p{i}", "max_tokens": 2}}) + "\n"
                for i in range(2)).encode()


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        await request.json()
        return {"choices": [{"text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    store = FileStore(tmp_path)
    runner = BatchRunner(tmp_path, store, app, concurrency=2)
    add_batch_routes(app, store, runner)
    await runner.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://replica/v1") as http:
        yield openai.AsyncOpenAI(base_url="http://replica/v1", api_key="unused",
                                 http_client=http, max_retries=0)
    await runner.shutdown()


def _in(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Move the clock `seconds` ahead."""
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + seconds)


async def test_an_upload_with_expires_after_expires(client: openai.AsyncOpenAI,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    f = await client.files.create(file=("in.jsonl", LINES), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    kept = await client.files.create(file=("kept.jsonl", LINES), purpose="batch")
    assert kept.expires_at is None
    assert (await client.files.retrieve(f.id)).expires_at == f.expires_at
    _in(monkeypatch, 3601)
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        await client.files.content(f.id)
    assert [x.id for x in (await client.files.list()).data] == [kept.id]


@pytest.mark.parametrize("policy", [{"anchor": "created_at", "seconds": 60},
                                    {"anchor": "created_at", "seconds": 31 * 24 * 3600},
                                    {"anchor": "last_active_at", "seconds": 3600}])
async def test_an_expiry_outside_openais_bounds_is_a_400(client: openai.AsyncOpenAI,
                                                         policy: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("in.jsonl", LINES), purpose="batch",
                                  expires_after=policy)  # type: ignore[arg-type]
    f = await client.files.create(file=("in.jsonl", LINES), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                    completion_window="24h",
                                    output_expires_after=policy)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "output_expires_after"  # type: ignore[index]


async def test_a_batch_with_output_expires_after_writes_expiring_files(
        client: openai.AsyncOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    f = await client.files.create(file=("in.jsonl", LINES), purpose="batch")
    batch = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert "output_expires_after_s" not in batch.model_dump()  # not an OpenAI field
    for _ in range(500):
        batch = await client.batches.retrieve(batch.id)
        if batch.status == "completed":
            break
        await asyncio.sleep(0.01)
    assert batch.status == "completed" and batch.output_file_id is not None
    output = await client.files.retrieve(batch.output_file_id)
    # anchored at the output file's creation, as OpenAI's
    assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200
    assert (await client.files.retrieve(f.id)).expires_at is None  # the input is not affected
    _in(monkeypatch, 7201)
    with pytest.raises(openai.NotFoundError):
        await client.files.content(batch.output_file_id)
    assert [x.id for x in (await client.files.list()).data] == [f.id]


async def test_the_scan_deletes_expired_files_nobody_looks_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk is given back without a lookup: each replica's periodic scan deletes the
    expired files (an expired file used to stay on disk until someone asked for it)."""
    store = FileStore(tmp_path)
    gone = store.create(BytesIO(LINES), "a.jsonl", "batch", owner="tenant-a",
                        expires_after_s=3600)
    kept = store.create(BytesIO(LINES), "b.jsonl", "batch", expires_after_s=7200)
    forever = store.create(BytesIO(LINES), "c.jsonl", "batch")
    runner = BatchRunner(tmp_path, store, FastAPI(), concurrency=1, scan_interval_s=0.01)
    await runner.start()
    try:
        _in(monkeypatch, 3601)
        for _ in range(500):
            if not (store.dir / gone["id"]).exists():
                break
            await asyncio.sleep(0.01)
    finally:
        await runner.shutdown()
    on_disk = {p.name for p in store.dir.iterdir()}
    assert on_disk == {kept["id"], f"{kept['id']}.json", forever["id"], f"{forever['id']}.json"}
