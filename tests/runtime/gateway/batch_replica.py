"""A replica that runs the real Batch API routes (no model) on a free loopback port, for the
gateway's Batch API tests: what the gateway forwards meets the replica's own code."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from argosy_runtime.server.batch.batch_runner import BatchRunner
from argosy_runtime.server.batch.file_store import MAX_FILE_BYTES, FileStore
from argosy_runtime.server.batch.routes import add_batch_routes
from argosy_runtime.server.errors import install_error_handlers
from fastapi import FastAPI


@dataclass
class BatchReplica:
    url: str
    files: FileStore
    runner: BatchRunner
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        await self.runner.shutdown()
        self.server.should_exit = True
        await self.task


async def start_batch_replica(root: Path, max_bytes: int = MAX_FILE_BYTES,
                              run_batches: bool = False) -> BatchReplica:
    """The routes over the folder `root`; `run_batches`: start the runner too (its batches'
    requests get the app's 404, there being no model)."""
    app = FastAPI()
    install_error_handlers(app)
    files = FileStore(root, max_bytes=max_bytes)
    runner = BatchRunner(root, files, app, concurrency=1)
    add_batch_routes(app, files, runner)
    app.get("/ready")(lambda: {"ready": True})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off",
                                           log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the replica did not start"
        await asyncio.sleep(0.01)
    if run_batches:
        await runner.start()
    port = server.servers[0].sockets[0].getsockname()[1]
    return BatchReplica(f"http://127.0.0.1:{port}", files, runner, server, task)
