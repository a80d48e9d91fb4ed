"""Scrape runtime replicas' Prometheus `/metrics` concurrently into `ReplicaSample`s.

Where a pod serves: `http://<status.podIP>:<port><path>`, with port and path from the pod's
`prometheus.io/port` / `prometheus.io/path` annotations (the operator's Deployment sets them;
defaults 8000 and /metrics). Tests point pods at loopback test servers by giving them podIP
127.0.0.1 and the test server's port in that annotation; `url_for` is also injectable.

A scrape that times out, errors, returns a non-200, a body over MAX_METRICS_BYTES or one that
lacks a gauge becomes a `ReplicaSample` with `None` metrics: the decision then treats the
replica as fully loaded, never as idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from argosy_operator.autoscaling.samples import ReplicaSample

KV_CACHE_USAGE = "argosy:kv_cache_usage_perc"
NUM_WAITING = "argosy:num_requests_waiting"
NUM_RUNNING = "argosy:num_requests_running"
BATCH_PENDING = "argosy:batch_requests_pending"  # optional: runtimes before the Batch API lack it
# A counter whose labelled series appear with the first finished request: absent means none.
NUM_FINISHED = "argosy:request_success_total"

PORT_ANNOTATION = "prometheus.io/port"
PATH_ANNOTATION = "prometheus.io/path"
DEFAULT_PORT = 8000
DEFAULT_PATH = "/metrics"
DEFAULT_TIMEOUT_SECONDS = 2.0
# The most of a /metrics body read. A runtime's is some kB (more with many LoRA adapters); a
# larger one is not the runtime's, and reading and parsing it would hold the operator's memory
# and CPU (every object's timer shares one event loop) for the whole scrape timeout.
MAX_METRICS_BYTES = 4 << 20

logger = logging.getLogger(__name__)


def parse_metrics(text: str) -> ReplicaSample:
    """A ready, measured `ReplicaSample` from Prometheus text exposition.

    Several series of one gauge (e.g. one per model_name label) are combined: KV usage by
    mean, request counts by sum; values are clamped into range. A missing KV or request gauge
    raises ValueError; a missing batch gauge counts as no batch requests, a missing
    finished-requests counter as none finished yet.
    """
    values: dict[str, list[float]] = {KV_CACHE_USAGE: [], NUM_WAITING: [], NUM_RUNNING: [],
                                      BATCH_PENDING: [], NUM_FINISHED: []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name].append(float(sample.value))
    missing = [name for name, v in values.items()
               if not v and name not in (BATCH_PENDING, NUM_FINISHED)]
    if missing:
        raise ValueError(f"metrics missing: {', '.join(missing)}")
    kv = values[KV_CACHE_USAGE]
    return ReplicaSample(ready=True, kv_cache_usage=min(max(sum(kv) / len(kv), 0.0), 1.0),
                         num_waiting=max(sum(values[NUM_WAITING]), 0.0),
                         num_running=max(sum(values[NUM_RUNNING]), 0.0),
                         batch_pending=max(sum(values[BATCH_PENDING]), 0.0),
                         num_finished=max(sum(values[NUM_FINISHED]), 0.0))


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True (and it is not being deleted)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pod_metrics_url(pod: Mapping[str, Any]) -> str | None:
    """`http://podIP:port/path` from status.podIP and the prometheus.io annotations."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        port = int(annotations.get(PORT_ANNOTATION, DEFAULT_PORT))
    except (TypeError, ValueError):
        port = DEFAULT_PORT
    path = annotations.get(PATH_ANNOTATION) or DEFAULT_PATH
    if not path.startswith("/"):
        path = "/" + path
    try:
        host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return None
    return f"http://{host}:{port}{path}"


async def _read_capped(resp: aiohttp.ClientResponse) -> str:
    """The body as text; ValueError past MAX_METRICS_BYTES (a Content-Length says so at
    once; a body without one is read only up to the cap)."""
    too_large = ValueError(f"/metrics body larger than {MAX_METRICS_BYTES} bytes")
    if (resp.content_length or 0) > MAX_METRICS_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_METRICS_BYTES:
            raise too_large
    return body.decode(resp.charset or "utf-8", errors="replace")


async def scrape_url(session: aiohttp.ClientSession, url: str, timeout: float) -> ReplicaSample:
    """One ready replica: measured on success, `None` metrics (scrape failed) otherwise."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            text = await _read_capped(resp)
        return parse_metrics(text)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001  # any failure is a failed scrape, never a crash
        logger.debug("scrape of %s failed: %r", url, exc)
        return ReplicaSample(ready=True)


async def scrape_pods(
    pods: Sequence[Mapping[str, Any]],
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    session: aiohttp.ClientSession | None = None,
    url_for: Callable[[Mapping[str, Any]], str | None] = pod_metrics_url,
) -> list[ReplicaSample]:
    """One sample per pod, in order, named after it: unready pods are not scraped; ready
    ones concurrently.

    The whole round takes at most about `timeout` seconds however many pods there are.
    """
    own_session = session is None
    if session is None:
        session = aiohttp.ClientSession()
    try:
        async def one(pod: Mapping[str, Any]) -> ReplicaSample:
            name = (pod.get("metadata") or {}).get("name")
            if not pod_is_ready(pod):
                return ReplicaSample(ready=False, name=name)
            url = url_for(pod)
            if url is None:
                return ReplicaSample(ready=True, name=name)  # unreachable: a failed scrape
            return dataclasses.replace(await scrape_url(session, url, timeout), name=name)

        return list(await asyncio.gather(*(one(p) for p in pods)))
    finally:
        if own_session:
            await session.close()
