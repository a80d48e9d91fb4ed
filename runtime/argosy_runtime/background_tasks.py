"""Background asyncio tasks (pollers, watchers) that must be gone when their owner stops.

Stopping one is "cancel, then wait until it has finished", so nothing it holds (a connection,
a lock, a file) outlives the owner. Waiting with `asyncio.wait` rather than awaiting the task
under `suppress(CancelledError)` keeps a cancellation of the *caller* (e.g. a shutdown that
is itself cancelled) propagating instead of being swallowed with the task's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None or finished: nothing to cancel) and wait until it has ended. A
    task that had failed is logged, not raised: its owner is stopping either way."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background task %s had failed", task.get_name(),
                       exc_info=task.exception())


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, Any], name: str | None = None) -> AsyncIterator[None]:
    """Run `coro` as a task while inside the block; cancel it and wait for it on the way out."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    try:
        yield
    finally:
        await cancel_and_wait(task)
