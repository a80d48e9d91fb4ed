"""merge_streams over several prompts' streams (a completions request with a list of
prompts): a reader that lags does not make the server queue every output meanwhile."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from argosy_runtime.server.serving_common import merge_streams


class _EagerStream:
    """Outputs as fast as they are asked for (a RequestStream whose engine runs ahead of the
    reader), counting how many were taken."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.taken = 0
        self.closed = False

    def __aiter__(self) -> _EagerStream:
        return self

    async def __anext__(self) -> object:
        if self.taken == self.count:
            raise StopAsyncIteration
        self.taken += 1
        await asyncio.sleep(0)
        return SimpleNamespace(outputs=[])  # a RequestOutput of no sequence failed

    def close(self) -> None:
        self.closed = True


def test_a_lagging_reader_holds_the_streams_back() -> None:
    """Each output is cumulative, and a RequestStream keeps only its newest while nobody
    takes it: the merge must not take them all ahead of the reader (it queued every one,
    memory as the square of the output length for a slow client)."""
    streams = [_EagerStream(1000) for _ in range(3)]

    async def read_one_then_lag() -> None:
        merged = merge_streams(streams)  # type: ignore[arg-type]
        await anext(merged)
        for _ in range(200):  # the reader is busy: the pumps run as far as they may
            await asyncio.sleep(0)
        assert sum(s.taken for s in streams) <= 2 * len(streams) + 1, [s.taken for s in streams]
        n = 1 + sum([1 async for _ in merged])  # the rest, read at last: nothing lost
        assert n == 3000
        await merged.aclose()

    asyncio.run(read_one_then_lag())
    assert all(s.closed for s in streams)
