"""Background responses (`background: true`): generation that outlives its HTTP request.

A background response runs as an asyncio task, not in the request that created it: the
create call answers at once (status `queued`), a client that disconnects from its stream
stops nothing, and `GET /v1/responses/{id}` shows it move queued -> in_progress ->
completed | incomplete | failed, or `cancelled` by `POST /v1/responses/{id}/cancel`.

The task reads the response's stream events (`stream_events.py`) and keeps every one of
them, so `GET /v1/responses/{id}?stream=true&starting_after=N` replays those after sequence
number N and then follows the live ones. The events belong to the stored entry
(`StoredResponse.run`), so they are bounded as the store is: dropped with the entry (LRU,
DELETE), lost on restart.

The engine request inside is an ordinary chat stream: it counts in the request metrics and
in the drain (`lifecycle.py`). One still running when the drain times out is stopped with
the others and ends `failed` (server_error, a last `response.failed` event), as any answer
the server cut short.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from argosy_runtime.server.responses.response_object import ABORTED

if TYPE_CHECKING:
    from argosy_runtime.server.responses.store import StoredResponse
    from argosy_runtime.server.responses.stream_events import ResponseEventStream

logger = logging.getLogger("argosy.server")

RUNNING = ("queued", "in_progress")


class BackgroundRun:
    """One background response: the task generating it, and its events so far (as sent:
    `event:` + `data:` text; event i has `sequence_number` i)."""

    def __init__(self, entry: StoredResponse) -> None:
        self.entry = entry  # its `response` is replaced as the run goes
        self.events: list[str] = []
        self.finished = False  # no event will come any more
        self.task: asyncio.Task[None] | None = None
        self._error = ABORTED  # why it failed if it stops before its final event
        # Replaced after each wake-up: followers wait on the one they saw, so none is missed.
        self._grew = asyncio.Event()

    def start(self, stream: ResponseEventStream, chat_chunks: AsyncIterator[str],
              close: Callable[[], None]) -> None:
        """Turn chat's chunks into `stream`'s events (its `on_done` must be `self.update`).
        `close` (abort the engine request if it still runs, release the drain counter) runs
        however the run ends, even cancelled before it began (a done callback: a `finally`
        would not run then)."""
        self.task = asyncio.get_running_loop().create_task(
            self._run(stream.translate(chat_chunks)))
        self.task.add_done_callback(lambda _: self._end(stream, close))

    def update(self, response: dict[str, Any]) -> None:
        """The response's new state (the stream's final object); never undoes a cancel."""
        if self.entry.response["status"] in RUNNING:
            self.entry.response = response

    async def _run(self, events: AsyncIterator[str]) -> None:
        self.update({**self.entry.response, "status": "in_progress"})
        try:
            async for event in events:
                self._add(event)
        except Exception as exc:  # the engine failed: not the client's doing
            logger.exception("background response %s failed", self.entry.response["id"])
            self._error = {"code": "server_error", "message": f"the server failed: {exc}"}

    def _end(self, stream: ResponseEventStream, close: Callable[[], None]) -> None:
        close()
        if self.entry.response["status"] in RUNNING:
            # Stopped before its final event (a drain, a shutdown, an engine failure): it
            # failed, as a request the server cut short does. The task stopped between two
            # chat chunks, so every event numbered so far is in `events`.
            self._add(stream.failed(self._error))
        self.finished = True
        self._wake()

    def _add(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `starting_after`, then the live ones until the
        end. Leaving early (a client disconnect) does not stop the run."""
        sent = starting_after + 1
        while True:
            grew = self._grew  # taken before reading, so an event added meanwhile wakes us
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.finished:
                return
            await grew.wait()

    async def cancel(self) -> None:
        """Stop a queued or running response: `cancelled`, its engine request aborted (KV
        blocks freed at the next engine step). A finished one is left as it is. OpenAI's
        stream has no cancelled event: followers' streams just end."""
        if self.entry.response["status"] not in RUNNING:
            return
        self.entry.response = {**self.entry.response, "status": "cancelled"}
        logger.info("background response %s cancelled after %d events",
                    self.entry.response["id"], len(self.events))
        await self.stop()

    def interrupt(self) -> None:
        """Cancel the task: it ends at its next await (`_end` runs then)."""
        if self.task is not None:
            self.task.cancel()

    async def stop(self) -> None:
        """Cancel the task and wait until it ended (its engine request is aborted by then:
        `_end` was registered before `wait`'s own callback, so it has run)."""
        self.interrupt()
        if self.task is not None:
            await asyncio.wait({self.task})


class BackgroundRuns:
    """The background runs of one server still going, for the drain and the shutdown."""

    def __init__(self) -> None:
        self._running: set[BackgroundRun] = set()

    def start(self, run: BackgroundRun, stream: ResponseEventStream,
              chat_chunks: AsyncIterator[str], close: Callable[[], None]) -> None:
        run.start(stream, chat_chunks, close)
        assert run.task is not None
        self._running.add(run)  # also the reference that keeps the task alive
        run.task.add_done_callback(lambda _: self._running.discard(run))

    def __len__(self) -> int:
        return len(self._running)

    def interrupt(self) -> None:
        """Stop them all, now (the drain ran out of time): each ends failed and releases
        its drain counter, so the drain ends."""
        for run in self._running:
            run.interrupt()

    async def shutdown(self) -> None:
        """Stop every run still going and wait for them (no task is left pending when the
        event loop closes)."""
        await asyncio.gather(*(run.stop() for run in list(self._running)))
