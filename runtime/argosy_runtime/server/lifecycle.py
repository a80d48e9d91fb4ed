"""Readiness and graceful drain.

On SIGTERM (Kubernetes' stop signal) the server does not stop listening at once, which would
turn in-flight work into connection resets and new requests into connection refusals. Instead:

1. `/ready` answers 503 (the Service stops routing here) and new generation requests get 503;
2. running requests, streams included, finish normally, bounded by `--drain-timeout`: those
   counted by `enter`, and every HTTP request already in flight when the drain began (one
   admitted but not counted yet, still tokenizing its prompt or compiling its grammar, or
   one never counted, a score or a classification);
3. whatever still runs after that is aborted, and uvicorn is asked to exit: exit code 0.

A second SIGINT/SIGTERM during the drain exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterable
from types import FrameType

import uvicorn

logger = logging.getLogger("argosy.server")


class Lifecycle:
    """Tracks readiness, draining and the generation requests in flight."""

    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.started = False
        self.draining = False
        self.num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_task: asyncio.Task[None] | None = None
        # Called with abort_all when the drain times out: work the engine abort alone does
        # not end (background responses, which no client connection waits on).
        self.on_drain_timeout: list[Callable[[], None]] = []

    @property
    def ready(self) -> bool:
        return self.started and not self.draining

    def enter(self) -> None:
        """Count one generation request as in flight (pair with exactly one `exit`)."""
        self.num_active += 1
        self._idle.clear()

    def exit(self) -> None:
        self.num_active -= 1
        if self.num_active <= 0:
            self.num_active = 0
            self._idle.set()

    def begin_drain(self, abort_all: Callable[[], None], on_done: Callable[[], None],
                    requests: Iterable[asyncio.Future[object]] = ()) -> None:
        """Start draining (idempotent); `on_done` runs once in-flight work ended or timed out.

        `requests`: the HTTP requests in flight now (uvicorn's tasks), waited for too. The
        counter alone missed a request that passed `check_accepting` but had not reached
        `enter` yet: the drain ended at once and uvicorn cut it short (its graceful timeout).
        Those arriving later are refused (503) or are probes: they are not waited for."""
        if self.draining:
            return
        self.draining = True
        pending = [r for r in requests if not r.done()]
        logger.info("draining: %d request(s) in flight (%d HTTP), timeout %.1fs",
                    self.num_active, len(pending), self.drain_timeout)
        self._drain_task = asyncio.get_running_loop().create_task(
            self._drain(abort_all, on_done, pending))

    async def _wait_idle(self, requests: list[asyncio.Future[object]]) -> None:
        if requests:
            await asyncio.wait(requests)
        await self._idle.wait()  # a request counted by `enter` ends with its response

    async def _drain(self, abort_all: Callable[[], None], on_done: Callable[[], None],
                     requests: list[asyncio.Future[object]] | None = None) -> None:
        start = time.monotonic()
        try:
            await asyncio.wait_for(self._wait_idle(requests or []),
                                   timeout=self.drain_timeout)
        except TimeoutError:
            logger.warning("drain timeout: aborting %d request(s)", self.num_active)
            abort_all()
            for stop in self.on_drain_timeout:
                stop()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=2.0)
        logger.info("drained in %.2fs", time.monotonic() - start)
        on_done()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle,
                 abort_all: Callable[[], None]) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.abort_all = abort_all
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn we do not re-raise the signal after shutdown: a drained exit is 0.
        if self.lifecycle.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT or self.lifecycle.draining
            return
        logger.info("received %s", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        # Snapshot on the event loop: the requests in flight as the drain begins.
        self.lifecycle.begin_drain(self.abort_all, self._exit,
                                   requests=list(self.server_state.tasks))

    def _exit(self) -> None:
        self.should_exit = True
