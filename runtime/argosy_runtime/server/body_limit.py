"""ASGI middleware: a request body larger than `--max-request-body-size` is a 413.

Without a cap a client could post any size: the body is held in memory, parsed as JSON and
validated on the event loop (a 16 MiB list of token ids takes ~0.8 s there) before any
handler can refuse it. A body announced too large by its Content-Length is refused before a
byte of it is read; a chunked one is read up to the limit, then refused.

`POST /v1/files` (Batch API uploads, up to 200 MiB) is exempt: it streams the file to disk
and enforces its own limit (batch/file_store.py, docs/batch.md).
"""

from __future__ import annotations

import json

from argosy_runtime.server.errors import error_body
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXEMPT_PATHS = frozenset({"/v1/files"})


def body_too_large(limit: int) -> str:
    return (f"request body is larger than this server's limit of {limit} bytes "
            f"({limit / 2**20:g} MiB, argosy serve --max-request-body-size)")


class BodySizeLimitMiddleware:
    """413 `request_too_large` for a body over `max_bytes` (0: no limit)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes or scope.get("path") in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        # Read the whole body here (it is at most max_bytes), then hand it to the app as one
        # message; later receive() calls (disconnect detection) go to the server as before.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _reject(self, send: Send) -> None:
        payload = json.dumps(error_body(body_too_large(self.max_bytes), "invalid_request_error",
                                        None, "request_too_large")).encode()
        # Connection: close, since the rest of the body is never read.
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
