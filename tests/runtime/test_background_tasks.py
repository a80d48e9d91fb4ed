"""Stopping background tasks: cancelled, waited for, and never swallowing the caller's cancel."""

from __future__ import annotations

import asyncio
import logging

import pytest
from argosy_runtime.background_tasks import cancel_and_wait, running


async def test_running_cancels_the_task_and_waits_for_its_cleanup() -> None:
    events: list[str] = []

    async def poll() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # cleanup that itself awaits: must finish before exit
            events.append("cleaned up")

    async with running(poll()):
        await asyncio.sleep(0)
        events.append("inside")
    assert events == ["inside", "cleaned up"]


async def test_a_cancel_of_the_stopping_caller_is_not_swallowed() -> None:
    """A shutdown that is itself cancelled (a second Ctrl-C, a timeout around it) must end:
    awaiting the task under suppress(CancelledError) would swallow the caller's cancel too."""
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await release.wait()

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(task))
    await asyncio.sleep(0.01)
    stopper.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await asyncio.wait([task])


async def test_a_failed_task_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("poller broke")

    task = asyncio.create_task(fails(), name="poller")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="argosy_runtime.background_tasks"):
        await cancel_and_wait(task)
        await cancel_and_wait(None)
    assert "background task poller had failed" in caplog.text
    assert "poller broke" in caplog.text
