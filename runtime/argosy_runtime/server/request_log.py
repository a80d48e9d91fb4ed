"""ASGI middleware: X-Request-Id, bearer auth, and one structured log line per request.

Written as plain ASGI rather than `BaseHTTPMiddleware`, which buffers through an extra task
and would hide client disconnects from streaming responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from argosy_runtime.server.auth import is_authorized, requires_auth
from argosy_runtime.server.errors import error_body
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("argosy.access")
MAX_REQUEST_ID_LEN = 128


def request_log(scope: Scope) -> dict[str, Any]:
    """The dict a handler fills with fields for this request's log line."""
    return scope.setdefault("state", {}).setdefault("argosy_log", {})


def request_id_of(scope: Scope) -> str:
    return scope.setdefault("state", {}).get("request_id") or uuid.uuid4().hex


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None = None,
                 on_response: Any = None) -> None:
        self.app = app
        self.api_key = api_key
        self.on_response = on_response  # (path, status) -> None, for the HTTP counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        # A client id is echoed as-is but bounded and printable (it lands in logs)
        request_id = given if given and len(given) <= MAX_REQUEST_ID_LEN and given.isprintable() \
            else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        log = request_log(scope)
        status, responded = 500, False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        path = scope.get("path", "")
        try:
            if self.api_key and requires_auth(path) and not is_authorized(
                    headers.get("authorization"), self.api_key):
                body = json.dumps(error_body("invalid or missing API key",
                                             "authentication_error", None,
                                             "invalid_api_key")).encode()
                await send_wrapper({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})
                await send_wrapper({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if not responded:
                # Cancelled before any answer: its caller left (a cancelled batch aborts its
                # in-process requests so), as a disconnected client's 499, not a server error.
                status = 499
            raise
        finally:
            if path not in ("/health", "/ready", "/metrics") or status >= 400:
                line = {"event": "request", "request_id": request_id,
                        "method": scope.get("method"), "path": path, "status": status,
                        "duration_ms": round((time.monotonic() - start) * 1000, 2),
                        "client": (scope.get("client") or ("", 0))[0], **log}
                access_logger.info(json.dumps(line, default=str))
            if self.on_response is not None:
                self.on_response(path, status)
