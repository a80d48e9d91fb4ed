"""A StreamingResponse that always runs a cleanup callback, however the stream ends.

Starlette cancels the body iterator when the client disconnects, and never starts it when the
client left before the response began; in both cases a generator's `finally` may not run. The
cleanup here (abort the engine requests, release the drain counter) runs in every case.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("argosy.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class GuardedStreamingResponse(StreamingResponse):
    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close: Callable[[], None] | None = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # client vanished mid-write
            pass
        finally:
            self.close()

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            try:
                on_close()
            except Exception:
                logger.exception("stream cleanup failed")
