"""Relaying a replica's answer to the client as it arrives, and the `code` it counts under in
argosy:gateway_requests_total.

Every answer the gateway streams through (generations, a stored response's events, a Batch
API file's content) goes through `relay`, so that each is counted the same way. The status
line goes out with the replica's status, but an answer cut short is not one:

- the whole answer went through: the replica's status;
- the client went away: 499 (nginx's "client closed request", as the tenants' counter has it);
  `relay` returns it when a write found the client gone, and raises CancelledError when the
  client's leaving cancelled the handler: the caller counts that as 499 too;
- the replica broke mid-answer: 502 (what the client's error event says,
  bad_gateway_error);
- anything else (a gateway bug, after the status line went out) raises: the caller counts
  the 500 it is.

Dashboards summing the counter then see every request, and these never pass for successes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from argosy_runtime.gateway.proxy.asked_usage import UsageEventRemover
from argosy_runtime.gateway.proxy.errors import end_stream_with_error

logger = logging.getLogger(__name__)

CLIENT_CLOSED = "499"  # the `code` of a request whose client went away (nginx's convention)
BROKEN = "502"  # the `code` of an answer whose replica broke mid-way
UNEXPECTED = "500"  # the `code` of an answer a gateway bug cut short


class StreamIdle(Exception):
    """The replica sent no bytes of an unfinished answer for `stream_idle_timeout_s`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no bytes for stream_idle_timeout_s ({seconds:g} s)")


async def relay(request: web.Request, out: web.StreamResponse,
                resp: aiohttp.ClientResponse, backend: str, *, first_chunk: bytes = b"",
                feed: Callable[[bytes], None] | None = None,
                idle_timeout_s: float | None = None,
                remove_usage: UsageEventRemover | None = None) -> str:
    """Prepare `out` and write `first_chunk` (bytes of the body already read), then the rest
    of `resp`'s body as it arrives, each piece also given to `feed` (whole: `remove_usage`
    takes the usage event the gateway asked for out of what the client gets, not out of what
    is metered, asked_usage.py); returns the code the
    answer counts under (see above). A replica (`backend`, its URL) that breaks mid-answer
    ends an event stream with an error event, and the client's connection is cut without a
    clean end, so that the client sees the answer was cut short (a stored response's events
    can then be resumed with `starting_after`). A replica that sends nothing for
    `idle_timeout_s` (None: no limit) counts as one that broke."""
    last = b""  # the last bytes relayed: does the stream so far end between two events?
    try:
        await out.prepare(request)
        if first_chunk:
            last = await _pass_on(out, first_chunk, feed, remove_usage, last)
        while True:
            try:
                async with asyncio.timeout(idle_timeout_s) as idle:
                    chunk = await resp.content.readany()
            except TimeoutError:
                if idle.expired():  # ours, not the session's own timeout
                    raise StreamIdle(idle_timeout_s) from None
                raise
            if not chunk:
                break
            last = await _pass_on(out, chunk, feed, remove_usage, last)
        if remove_usage is not None and (rest := remove_usage.rest()):
            await out.write(rest)
        await out.write_eof()
    except ConnectionResetError:
        # A write found the client gone (also a client that closes right after the last
        # event, before the end of the chunked body): nothing to answer. Before the replica's
        # errors: aiohttp's ClientConnectionResetError is both.
        return CLIENT_CLOSED
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError,
            StreamIdle) as exc:
        # The replica died or hung mid-answer (or its answer outlasted the session's timeout);
        # bytes already reached the client, so no retry.
        logger.warning("replica %s broke mid-answer: %s", backend, exc)
        if resp.content_type == "text/event-stream":  # a JSON body has no room for one
            await end_stream_with_error(out, last, backend)
        if request.transport is not None:
            request.transport.close()
        return BROKEN
    return str(resp.status)


async def _pass_on(out: web.StreamResponse, chunk: bytes, feed: Callable[[bytes], None] | None,
                   remove_usage: UsageEventRemover | None, last: bytes) -> bytes:
    """Write `chunk` (less the usage event the gateway asked for) and meter it; returns the
    last bytes relayed so far."""
    sent = chunk if remove_usage is None else remove_usage(chunk)
    if sent:
        await out.write(sent)
    if feed is not None:
        feed(chunk)
    return (last + sent)[-4:]
