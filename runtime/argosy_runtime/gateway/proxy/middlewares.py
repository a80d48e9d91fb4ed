"""The gateway's own middlewares around every handler: an OpenAI-shaped 500 for a bug in the
gateway (`internal_error`), a 400 for a request body that cannot be read (`unreadable_body`),
and a 408 for one that stops arriving (`body_timeout`). proxy/app.py installs them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from argosy_runtime.gateway.proxy.errors import bad_request, error_response

logger = logging.getLogger(__name__)


@web.middleware
async def internal_error(request: web.Request, handler: Any) -> web.StreamResponse:
    """A bug in the gateway (an exception no handler expected) answers an OpenAI-shaped 500,
    not aiohttp's plain-text page, which the openai client cannot read, and logs the
    traceback."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise  # aiohttp's own answers (404, 405, 413, ...): the client's errors, not ours
    except Exception as exc:
        if request.writer.output_size > 0:
            # The answer has started: only cutting the connection is left, which aiohttp
            # does (and logs the traceback).
            raise
        logger.exception("%s %s failed in the gateway", request.method, request.path)
        if isinstance(exc, TimeoutError):  # aiohttp answers one with a 504: keep its status
            return error_response(504, "the gateway timed out handling this request")
        # As the runtime server answers its own: nothing of the exception leaks to clients.
        return error_response(500, "internal server error (in the gateway; see its log)")


@web.middleware
async def unreadable_body(request: web.Request, handler: Any) -> web.StreamResponse:
    """A request body aiohttp cannot read (a Content-Encoding that does not decode, a broken
    chunked encoding) is the client's error: a 400, not a bug in the gateway (internal_error's
    500, its traceback logged)."""
    try:
        return await handler(request)
    except web.RequestPayloadError as exc:
        if request.writer.output_size > 0:
            raise
        # "400, message:\n  Can not decode content-encoding: gzip" -> the message alone
        reason = " ".join(str(exc).split("message:", 1)[-1].split())
        return bad_request(f"the request body cannot be read: {reason}")


def body_timeout(timeout_s: float) -> Any:
    """The middleware that answers 408 to a request whose body stops arriving: no byte of it
    for `timeout_s` (config: `client_body_timeout_s`). A watchdog, not a timeout around each
    read, so that every way a handler reads a body (whole, or a streamed upload) is covered.
    The check runs every quarter of the timeout, so a stall is caught within 1.25x of it."""
    step = timeout_s / 4

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        content = request.content
        if content.is_eof():  # no body, or all of it came with the headers: nothing to wait
            return await handler(request)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        seen = content.total_bytes
        last_progress = loop.time()
        expired = False

        def check() -> None:
            nonlocal seen, last_progress, expired, timer
            if content.is_eof():
                return  # the whole body is in: whatever the handler does next is not ours
            if content.total_bytes != seen:
                seen, last_progress = content.total_bytes, loop.time()
            elif loop.time() - last_progress >= timeout_s:
                expired = True
                task.cancel()  # the handler waits on the body: stop it there
                return
            timer = loop.call_later(step, check)

        timer = loop.call_later(step, check)
        try:
            return await handler(request)
        except asyncio.CancelledError:
            # Ours alone (not also the client going away, nor a shutdown): answer it.
            if not expired or task.uncancel() > 0 or request.writer.output_size > 0:
                raise
            logger.info("%s %s: no body bytes for %g s; answered 408", request.method,
                        request.path, timeout_s)
            resp = error_response(
                408, f"the request body stopped arriving: no bytes of it for {timeout_s:g} s",
                code="request_timeout")
            # The rest of the body may never come: send the answer, then close at once
            # (aiohttp would otherwise linger up to 10 s reading what is left of the body).
            resp.force_close()  # "Connection: close"
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:
                request.transport.close()  # after what is buffered (the answer) is written
            return resp
        finally:
            timer.cancel()

    return middleware
