"""ASGI middleware: a request body larger than `--max-request-body-size` is a 413.

Without a cap a client could post any size: the body is held in memory, parsed as JSON and
validated on the event loop (a 16 MiB list of token ids takes ~0.8 s there) before any
handler can refuse it. A body announced too large by its Content-Length is refused before a
byte of it is read; a chunked one is read up to the limit, then refused.

`POST /v1/files` (Batch API uploads, up to 200 MiB) has a limit of its own instead: the file
limit (batch/file_store.py, docs/batch.md) plus room for the form around the file. The form
is parsed (and its file spooled to a temporary file) before the route's own check can run, so
without a cap here an upload of any size was spooled to disk whole before its 413. Past the
cap the upload is refused with the store's 413 `file_too_large`; the rest of the body is read
and dropped for at most `UPLOAD_DRAIN_S` first, so a client still sending gets the answer
rather than a reset connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from argosy_runtime.server.batch.file_store import MAX_FILE_BYTES, file_too_large
from argosy_runtime.server.errors import error_body
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UPLOAD_PATHS = frozenset({"/v1/files"})
UPLOAD_FORM_BYTES = 1 << 20  # an upload's form around its file: boundaries, headers, purpose
UPLOAD_DRAIN_S = 10.0  # how long the rest of an upload over the cap is read and dropped


class _UploadTooLarge(Exception):
    """Raised into the form parser once an upload passes its cap (the app answers nothing)."""


def body_too_large(limit: int) -> str:
    return (f"request body is larger than this server's limit of {limit} bytes "
            f"({limit / 2**20:g} MiB, argosy serve --max-request-body-size)")


class BodySizeLimitMiddleware:
    """413 `request_too_large` for a body over `max_bytes` (0: no limit)."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 upload_max_bytes: int = MAX_FILE_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.upload_max_bytes = upload_max_bytes  # the file store's limit (a 413 above it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in UPLOAD_PATHS:
            await self._upload(scope, receive, send)
            return
        if scope["type"] != "http" or not self.max_bytes:
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
            if message["type"] != "http.request":
                # The client left before its body was whole. Handed on, FastAPI answered the
                # cut body 400 "There was an error parsing the body" (a client mistake in the
                # access log and argosy:http_requests_total); it is a request whose client
                # left before its answer, 499 as the handlers count it. No one reads this.
                await send({"type": "http.response.start", "status": 499, "headers": []})
                await send({"type": "http.response.body", "body": b""})
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

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An upload, cut off at its file limit plus the form's room: past that the app's
        form parsing fails (its answer dropped) and the client gets the store's 413."""
        cap = self.upload_max_bytes + UPLOAD_FORM_BYTES
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            # A client waiting for `100 Continue` (curl's way with a large file) has sent
            # nothing yet: answer at once. Reading would ask it for the whole body.
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await _drain(receive)
            await self._reject_upload(send)
            return
        size = 0
        over = False

        async def counted() -> Message:
            nonlocal size, over
            message = await receive()
            if message["type"] == "http.request" and not over:
                size += len(message.get("body", b""))
                if size > cap:
                    over = True
                    if message.get("more_body", False):
                        await _drain(receive)
            if over:
                raise _UploadTooLarge
            return message

        async def guarded(message: Message) -> None:
            if not over:  # else the app's answer to the broken form: ours replaces it
                await send(message)

        try:
            await self.app(scope, counted, guarded)
        except _UploadTooLarge:
            pass
        if over:
            await self._reject_upload(send)

    async def _reject_upload(self, send: Send) -> None:
        await _send_413(send, file_too_large(self.upload_max_bytes), "file", "file_too_large")

    async def _reject(self, send: Send) -> None:
        await _send_413(send, body_too_large(self.max_bytes), None, "request_too_large")


async def _send_413(send: Send, message: str, param: str | None, code: str) -> None:
    payload = json.dumps(error_body(message, "invalid_request_error", param, code)).encode()
    # Connection: close, since the rest of the body is never read (or only drained).
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, for at most UPLOAD_DRAIN_S."""

    async def drop() -> None:
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drop(), UPLOAD_DRAIN_S)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
