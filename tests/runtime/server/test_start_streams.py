"""start_streams admits every prompt of a request, all or none: also when the request is
cancelled while its prompts are being admitted (a cancelled batch cancels its in-process
requests; a beam search's deadline cancels its step)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from argosy_runtime.server.serving_common import start_streams


class _Stream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Engine:
    """Admits prompt 0 at once; prompt 1 waits (the engine thread busy with a long step)."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        self.cancelled: list[str] = []

    async def add(self, request_id: str, prompt: list[int], params: object,
                  priority: int = 0, lora_name: str | None = None) -> _Stream:
        if prompt == [1]:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # AsyncEngine.add aborts its own request then
                self.cancelled.append(request_id)
                raise
        stream = _Stream(request_id)
        self.streams.append(stream)
        return stream


def test_a_request_cancelled_while_admitting_aborts_the_prompts_already_admitted() -> None:
    engine = _Engine()
    ctx = SimpleNamespace(engine=engine, lora_name=lambda name: None)

    async def main() -> None:
        task = asyncio.create_task(start_streams(ctx, "cmpl-1", [[0], [1]], None, "m"))
        while not engine.streams:  # prompt 0 admitted, prompt 1 still waiting
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("start_streams swallowed the cancellation")

    asyncio.run(main())
    assert engine.cancelled == ["cmpl-1-1"]
    assert [(s.request_id, s.closed) for s in engine.streams] == [("cmpl-1-0", True)]
