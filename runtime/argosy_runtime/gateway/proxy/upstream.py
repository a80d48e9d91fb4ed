"""Sending one request to a replica, with one retry on another replica before the first byte.

A request is *committed* to a replica once the replica has sent the first byte of the answer's
body (or an answer that is the client's own fault, a 4xx). Until then nothing has reached the
client, so a refused connection, a 5xx, a full queue (429) or a replica that dies while the
request waits in its queue is retried on another replica. After it, the answer streams through.
With `first_byte_timeout_s` set, a replica that has not sent that first byte in time counts as
a failed try too (its connection is closed, so it drops the request).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import GatewayConfig
from argosy_runtime.gateway.metrics import GatewayMetrics
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.proxy.errors import (
    error_response,
    is_openai_error,
    no_replica,
    replica_error,
    retry_after_value,
)

logger = logging.getLogger(__name__)

# Errors that mean "the replica did not take the request": safe to send it elsewhere.
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError, asyncio.TimeoutError)
_BROKEN_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
DEFAULT_RETRY_AFTER_S = 1.0
# The longest Retry-After a replica is taken at its word for. Nothing but time ends a
# cooldown (good probes do not), so "inf" or "1e12" would keep the replica out for good (and
# "inf" made the 429's own Retry-After an OverflowError, a 500).
MAX_RETRY_AFTER_S = 300.0


@dataclass
class Upstream:
    """A committed answer: the replica, its open response, and the body's first chunk."""

    replica: Replica
    response: aiohttp.ClientResponse
    first_chunk: bytes

    def release(self) -> None:
        """Close the upstream connection (frees the replica's KV if the answer is unfinished)
        and stop counting the request against the replica."""
        if not self.response.closed:
            self.response.close()
        self.replica.in_flight -= 1


def parse_retry_after(value: str | None) -> float:
    """Seconds from a `Retry-After` header (delta-seconds form; dates, and values that are
    not finite numbers, fall back to 1 s), at most MAX_RETRY_AFTER_S."""
    try:
        seconds = float(value) if value else DEFAULT_RETRY_AFTER_S
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
    if not math.isfinite(seconds):  # "nan", "inf": not a delay
        return DEFAULT_RETRY_AFTER_S
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)


async def send(
    *,
    session: aiohttp.ClientSession,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    pool: ReplicaPool,
    policy: Policy,
    route: RouteRequest,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    adapter: str | None = None,
) -> Upstream | web.Response:
    """Try up to `config.max_attempts` distinct replicas; an Upstream, or the error to return.

    `adapter`: the LoRA adapter the request names; replicas known not to serve it (adapters
    come and go while replicas run) are skipped unless no replica is left, in which case a
    replica answers the client its own "model does not exist"."""
    tried: set[str] = set()
    last_error: web.Response | None = None
    timeout = aiohttp.ClientTimeout(
        total=None, connect=config.connect_timeout_s, sock_connect=config.connect_timeout_s
    )
    for _ in range(config.max_attempts):
        candidates = pool.available(exclude=tried)
        if adapter is not None:
            candidates = [r for r in candidates if r.may_serve_adapter(adapter)] or candidates
        replica = policy.choose(candidates, route)
        if replica is None:
            break
        tried.add(replica.url)
        replica.in_flight += 1
        committed = False
        try:
            try:
                # None: no deadline. Cancelling _attempt closes the replica's response.
                async with asyncio.timeout(config.first_byte_timeout_s):
                    outcome = await _attempt(session, config, metrics, pool, replica, path,
                                             body, headers, timeout)
            except TimeoutError:
                outcome = _first_byte_timed_out(config, metrics, pool, replica)
            if isinstance(outcome, Upstream):
                committed = True
                return outcome
            if outcome is not None:
                last_error = outcome
        finally:
            # Not committed (retry, error, or cancelled by a client disconnect): the replica
            # no longer holds this request.
            if not committed:
                replica.in_flight -= 1
    if last_error is not None:
        if last_error.status == 429:
            # Every replica we tried is full: report when the first one will take work again.
            wait = pool.earliest_retry_after()
            if wait is not None:
                last_error.headers["Retry-After"] = retry_after_value(wait)
        return last_error
    return no_replica(pool.model, pool.earliest_retry_after() if _all_cooling(pool) else None)


async def _attempt(
    session: aiohttp.ClientSession,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    pool: ReplicaPool,
    replica: Replica,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout: aiohttp.ClientTimeout,
) -> Upstream | web.Response | None:
    """One try: an Upstream when committed, else the upstream's error (or None) to retry."""
    try:
        resp = await session.post(replica.url + path, data=body, headers=headers, timeout=timeout)
    except _CONNECT_ERRORS as exc:
        # Refused (or no connection in time): out of rotation now, probes bring it back.
        replica.healthy = False
        replica.consecutive_successes = 0
        metrics.retries.labels(pool.model, "connect_error").inc()
        logger.warning("replica %s refused the request: %r", replica.url, exc)
        return None
    except _BROKEN_ERRORS as exc:
        # Reset before any answer. Also what a pooled keep-alive connection the replica had
        # just closed looks like, so this only counts toward `unhealthy_after`.
        replica.mark_failure(config.health.unhealthy_after)
        metrics.retries.labels(pool.model, "connection_reset").inc()
        logger.warning("replica %s dropped the request before answering: %r", replica.url, exc)
        return _dropped(replica, exc)
    except aiohttp.ClientResponseError as exc:
        # An answer that is not HTTP (a bad status line or headers: another service on that
        # port, a broken proxy). A failed try like a 5xx, retried elsewhere; the last one is
        # the client's 502 naming the replica, not an unhandled exception's bare 500.
        replica.mark_failure(config.health.unhealthy_after)
        metrics.retries.labels(pool.model, "invalid_answer").inc()
        logger.warning("replica %s sent an answer that is not HTTP: %r", replica.url, exc)
        return error_response(502, f"replica {replica.url} sent an answer that is not valid "
                                   f"HTTP: {str(exc.message)[:200]}")
    if resp.status == 429 or resp.status >= 500:
        data = await _read_quietly(resp)
        openai_error = is_openai_error(data)
        if resp.status == 429:
            replica.set_retry_after(parse_retry_after(resp.headers.get("Retry-After")))
            metrics.retries.labels(pool.model, "retry_after").inc()
        else:
            # The runtime's own 500 is one request failing (an exception on it, a generation
            # that failed): the replica answered, and its engine trouble answers 503. Counted
            # toward `unhealthy_after`, a client resending one such request would take every
            # replica out of rotation (each try lands on another one) and fail all the others'
            # requests with 503s.
            if not (resp.status == 500 and openai_error):
                replica.mark_failure(config.health.unhealthy_after)
            if resp.headers.get("Retry-After"):  # e.g. a draining replica's 503
                replica.set_retry_after(parse_retry_after(resp.headers["Retry-After"]))
            metrics.retries.labels(pool.model, "upstream_5xx").inc()
        retry_after = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        if not openai_error:
            # Not the runtime's own error: clients get the OpenAI shape all the same.
            return replica_error(resp.status, replica.url, data, retry_after)
        return web.Response(
            status=resp.status,
            body=data,
            content_type=resp.content_type or "application/json",
            headers=retry_after,
        )
    try:
        first = await resp.content.readany()
    except _BROKEN_ERRORS as exc:
        # Headers came, the body did not: the replica died with the request in its queue.
        resp.close()
        replica.mark_failure(config.health.unhealthy_after)
        metrics.retries.labels(pool.model, "broken_before_first_byte").inc()
        logger.warning("replica %s broke before the first byte: %r", replica.url, exc)
        return _dropped(replica, exc)
    except BaseException:  # cancelled by a client disconnect
        resp.close()
        raise
    return Upstream(replica=replica, response=resp, first_chunk=first)


def _dropped(replica: Replica, exc: Exception) -> web.Response:
    """The client's 502 when the last try's replica cut the request before any answer. The
    replica stays in rotation (a reset only counts toward `unhealthy_after`), so the 503 "no
    replica is available" the client got instead pointed at scaling, not at a crash."""
    return error_response(502, f"replica {replica.url} closed the connection before "
                               f"answering: {exc!r}")


def _first_byte_timed_out(config: GatewayConfig, metrics: GatewayMetrics, pool: ReplicaPool,
                          replica: Replica) -> web.Response:
    """A try that hit `first_byte_timeout_s`: a failure toward `unhealthy_after` (a hung
    replica leaves rotation, a busy one stays), and the client's 504 if no try is left."""
    replica.mark_failure(config.health.unhealthy_after)
    metrics.retries.labels(pool.model, "first_byte_timeout").inc()
    logger.warning("replica %s sent no answer within first_byte_timeout_s (%g s)",
                   replica.url, config.first_byte_timeout_s)
    return error_response(504, f"replica {replica.url} sent no answer within "
                               f"first_byte_timeout_s ({config.first_byte_timeout_s:g} s)")


def _all_cooling(pool: ReplicaPool) -> bool:
    """True when healthy replicas exist but all are inside a Retry-After window."""
    now = time.monotonic()
    healthy = [r for r in pool.replicas if r.healthy]
    return bool(healthy) and all(now < r.cooldown_until for r in healthy)


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except _BROKEN_ERRORS:
        return b""
    finally:
        resp.release()
