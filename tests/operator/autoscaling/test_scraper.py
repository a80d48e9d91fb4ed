"""The scraper against live loopback HTTP servers (aiohttp), parsing real Prometheus text."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from argosy_operator.autoscaling.samples import ReplicaSample
from argosy_operator.autoscaling.scraper import (
    MAX_METRICS_BYTES,
    parse_metrics,
    pod_is_ready,
    pod_metrics_url,
    scrape_pods,
)
from prometheus_client import CollectorRegistry, Gauge, generate_latest


def prometheus_text(kv: float, waiting: float, running: float, models: int = 1,
                    batch: float | None = None) -> bytes:
    registry = CollectorRegistry()
    names = ["argosy:kv_cache_usage_perc", "argosy:num_requests_waiting",
             "argosy:num_requests_running"]
    values = [kv, waiting, running]
    if batch is not None:  # runtimes before the Batch API do not export it
        names.append("argosy:batch_requests_pending")
        values.append(batch)
    gauges = [Gauge(name, name, ["model_name"], registry=registry) for name in names]
    # Other metrics a runtime also exports must be ignored.
    Gauge("argosy:cache_config_info", "x", ["block_size"], registry=registry).labels("16").set(1)
    for m in range(models):
        for gauge, value in zip(gauges, values, strict=True):
            gauge.labels(f"m{m}").set(value)
    return generate_latest(registry)


def gauges(sample: ReplicaSample) -> tuple[float | None, ...]:
    return (sample.kv_cache_usage, sample.num_waiting, sample.num_running, sample.batch_pending)


Handler = Callable[[web.Request], Any]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Any]]:
    """`port = await serve(handler)`: a live server on 127.0.0.1 for GET /metrics."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> int:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    yield start
    for runner in runners:
        await runner.cleanup()


def pod(port: int | None, ready: bool = True, ip: str | None = "127.0.0.1",
        **annotations: str) -> dict[str, Any]:
    ann = dict(annotations)
    if port is not None:
        ann["prometheus.io/port"] = str(port)
    status: dict[str, Any] = {"conditions": [{"type": "Ready",
                                               "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": {"name": f"p{port}", "annotations": ann}, "status": status}


def test_parse_metrics_combines_series() -> None:
    assert gauges(parse_metrics(prometheus_text(0.5, 3, 2).decode())) == (0.5, 3.0, 2.0, 0.0)
    # Two models on one replica: KV usage averages, request counts add up.
    assert gauges(parse_metrics(prometheus_text(0.5, 3, 2, models=2, batch=7).decode())) == \
        (0.5, 6.0, 4.0, 14.0)
    assert parse_metrics(prometheus_text(0.5, 0, 0, batch=7).decode()).holds_batches
    with pytest.raises(ValueError, match="argosy:num_requests_waiting"):
        parse_metrics("# TYPE argosy:kv_cache_usage_perc gauge\n"
                      "argosy:kv_cache_usage_perc 0.1\nargosy:num_requests_running 1\n")


def test_pod_metrics_url_and_readiness() -> None:
    assert pod_metrics_url(pod(None)) == "http://127.0.0.1:8000/metrics"
    assert pod_metrics_url(pod(9100, **{"prometheus.io/path": "stats"})) == \
        "http://127.0.0.1:9100/stats"
    assert pod_metrics_url(pod(9100, ip="fd00::5")) == "http://[fd00::5]:9100/metrics"
    assert pod_metrics_url(pod(9100, ip=None)) is None
    assert pod_is_ready(pod(1)) and not pod_is_ready(pod(1, ready=False))
    assert not pod_is_ready({"status": {}})
    terminating = pod(1)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not pod_is_ready(terminating)


async def test_scrape_pods_mixed_fleet(serve: Any) -> None:
    async def good(request: web.Request) -> web.Response:
        return web.Response(body=prometheus_text(0.25, 7, 3), content_type="text/plain")

    async def error(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="this is { not prometheus")

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(2.0)  # far past the 0.5 s scrape timeout
        return web.Response(text="")

    unscraped_hits = 0

    async def counted(request: web.Request) -> web.Response:
        nonlocal unscraped_hits
        unscraped_hits += 1
        return await good(request)

    ports = [await serve(h) for h in (good, error, garbage, hang, counted)]
    pods = [pod(ports[0]), pod(ports[1]), pod(ports[2]), pod(ports[3]),
            pod(ports[4], ready=False), pod(ports[0]), pod(ports[0], ip=None)]
    started = time.monotonic()
    samples = await scrape_pods(pods, timeout=0.5)
    elapsed = time.monotonic() - started
    assert samples[0].is_measured
    assert (samples[0].kv_cache_usage, samples[0].num_waiting, samples[0].num_running) == \
        (0.25, 7.0, 3.0)
    for failed in (samples[1], samples[2], samples[3], samples[6]):
        assert failed.ready and not failed.is_measured and failed.kv_cache_usage is None
    assert not samples[4].ready and unscraped_hits == 0  # unready pods are not scraped
    assert samples[5] == samples[0]
    assert elapsed < 1.5  # the hanging server costs one timeout (0.5 s), not its 2 s


async def test_connection_refused_is_a_failed_scrape() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    samples = await scrape_pods([pod(port)], timeout=0.5)
    assert samples[0].ready and not samples[0].is_measured


async def test_an_oversized_metrics_body_is_a_failed_scrape(
        serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A /metrics body over MAX_METRICS_BYTES is not read to its end (it would hold the
    operator's memory and CPU for the whole timeout), with or without a Content-Length."""
    def padded(size: int) -> bytes:
        body = prometheus_text(0.25, 7, 3)
        return body + b"# padding\n" * ((size - len(body)) // 10 + 1)

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=padded(MAX_METRICS_BYTES + 1), content_type="text/plain")

    async def streamed(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        body = padded(MAX_METRICS_BYTES + 1)
        for i in range(0, len(body), 1 << 16):
            await resp.write(body[i:i + (1 << 16)])
        return resp

    async def large_but_within(request: web.Request) -> web.Response:
        return web.Response(body=padded(MAX_METRICS_BYTES // 2), content_type="text/plain")

    ports = [await serve(h) for h in (sized, streamed, large_but_within)]
    with caplog.at_level(logging.DEBUG, logger="argosy_operator.autoscaling.scraper"):
        samples = await scrape_pods([pod(p) for p in ports], timeout=2.0)
    assert [(s.ready, s.is_measured) for s in samples] == [(True, False), (True, False),
                                                           (True, True)]
    reasons = [r.getMessage() for r in caplog.records if "larger than" in r.getMessage()]
    assert len(reasons) == 2, caplog.text


async def test_scrapes_run_concurrently(serve: Any) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.Response(body=prometheus_text(0.1, 0, 1), content_type="text/plain")

    ports = [await serve(slow) for _ in range(8)]
    started = time.monotonic()
    samples = await scrape_pods([pod(p) for p in ports], timeout=2.0)
    elapsed = time.monotonic() - started
    assert all(s.is_measured for s in samples)
    assert elapsed < 8 * 0.3 / 2  # sequential would take 2.4 s


def test_parses_what_the_runtime_server_exports() -> None:
    # The runtime's own metrics registry (argosy serve's /metrics), without loading a model.
    from argosy_runtime.outputs import EngineStats
    from argosy_runtime.server.metrics import ServerMetrics

    metrics = ServerMetrics("smollm2-135m")
    metrics.attach_engine(lambda: EngineStats(num_requests_running=5, kv_cache_usage=0.42),
                          lambda: 3, {"block_size": "16"})
    metrics.on_scheduled(0.01)
    metrics.on_first_token(0.05)
    metrics.batch_pending.set_function(lambda: 12)
    assert gauges(parse_metrics(metrics.render().decode())) == (0.42, 3.0, 5.0, 12.0)


def test_a_dead_engines_page_is_no_load_sample() -> None:
    """A replica whose engine died exports no load gauges: until its readiness probe fails
    (periods of seconds) the pod still counts as ready, and its last snapshot, frozen, was
    read as its load. The scraper now takes the page for an unmeasured replica, which the
    decision counts as fully loaded."""
    from argosy_runtime.outputs import EngineStats
    from argosy_runtime.server.metrics import ServerMetrics

    alive = [True]
    metrics = ServerMetrics("smollm2-135m")
    metrics.attach_engine(lambda: EngineStats(num_requests_running=5, kv_cache_usage=0.42),
                          lambda: 3, {"block_size": "16"}, is_alive=lambda: alive[0])
    assert gauges(parse_metrics(metrics.render().decode()))[:3] == (0.42, 3.0, 5.0)
    alive[0] = False
    page = metrics.render().decode()
    assert "argosy:kv_cache_usage_perc" not in page and "argosy:prompt_tokens_total" in page
    with pytest.raises(ValueError, match="metrics missing"):
        parse_metrics(page)
