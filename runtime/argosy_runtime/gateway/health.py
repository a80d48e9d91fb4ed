"""Active health checks: probe every replica's /ready and scrape its /metrics.

A replica that fails `unhealthy_after` probes in a row (refused, timed out, not 200 on /ready,
which includes a draining replica) leaves rotation; the probes go on, and `healthy_after`
good ones put it back. The proxy adds passive checks: a refused connection takes a replica out
at once, without waiting for the next probe.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from argosy_runtime.background_tasks import cancel_and_wait
from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import HealthConfig

logger = logging.getLogger(__name__)

# Sample name on the replica's /metrics -> Replica field.
SCRAPED = {
    "argosy:kv_cache_usage_perc": "kv_cache_usage",
    "argosy:num_requests_waiting": "num_waiting",
    "argosy:num_requests_running": "num_running",
    "argosy:batch_requests_pending": "batch_pending",
    "argosy:prefix_cache_queries_total": "prefix_cache_queries",
    "argosy:prefix_cache_hits_total": "prefix_cache_hits",
    "argosy:request_success_total": "num_finished",
}


# Adapters a replica holds in memory now.
LOADED_ADAPTERS = "argosy:lora_adapter_loaded"
# Adapters a replica serves, loaded or loaded by their first request (--max-loaded-loras);
# older replicas export only LOADED_ADAPTERS, where every adapter served is loaded.
REGISTERED_ADAPTERS = "argosy:lora_adapter_registered"


def _adapter_names(family: Metric) -> frozenset[str]:
    return frozenset(
        s.labels["lora_name"] for s in family.samples if s.value > 0 and "lora_name" in s.labels
    )


def parse_replica_metrics(text: str) -> dict[str, Any]:
    """The load fields found in a Prometheus text page (summed over label sets), and, when it
    has an adapter family at all, `adapters`: the LoRA adapters it serves (listed loaded or
    registered) and `loaded_adapters`: those listed loaded."""
    found: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (LOADED_ADAPTERS, REGISTERED_ADAPTERS):
            names = _adapter_names(family)
            found["adapters"] = found.get("adapters", frozenset()) | names
            if family.name == LOADED_ADAPTERS:
                found["loaded_adapters"] = names
            else:
                found.setdefault("loaded_adapters", frozenset())
            continue
        for sample in family.samples:
            field = SCRAPED.get(sample.name)
            # NaN or ±Inf (a gauge whose replica divided by zero, another service's page)
            # would poison the policies' load arithmetic: least-load compares scores, and a
            # NaN one makes every comparison false. Such a sample says nothing; skip it.
            if field is not None and math.isfinite(sample.value):
                found[field] = found.get(field, 0.0) + float(sample.value)
    return found


def estimate_unscraped_load(pool: ReplicaPool) -> None:
    """Give each replica of `pool` whose last scrape failed the KV usage and queue depth of
    the busiest replica of the pool that was scraped (0 when none was).

    Its own gauges are from its last good scrape, however old: kept, a replica that stopped
    answering scrapes (often because it is swamped) would look as idle as it last was and
    draw the model's traffic for as long as /ready still answers. Assumed as busy as the
    busiest one seen, it is never preferred for looking idle, and never starved either: it
    still ties with that one, and in-flight counts (exact) tell them apart."""
    scraped = [r for r in pool.replicas if r.scraped]
    for replica in pool.replicas:
        if not replica.scraped:
            replica.kv_cache_usage = max((r.kv_cache_usage for r in scraped), default=0.0)
            replica.num_waiting = max((r.num_waiting for r in scraped), default=0.0)


class HealthChecker:
    """Probes all replicas of all pools every `config.interval_s` (a background task)."""

    def __init__(
        self,
        pools: Callable[[], Iterable[ReplicaPool]],
        config: HealthConfig,
        session: aiohttp.ClientSession,
    ) -> None:
        self._pools = pools
        self.config = config
        self._session = session
        self._task: asyncio.Task[None] | None = None

    async def probe(self, replica: Replica) -> bool:
        """One probe: scrape /metrics (best effort), then /ready decides."""
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        scraped = False
        try:
            async with self._session.get(f"{replica.url}/metrics", timeout=timeout) as resp:
                if resp.status == 200:
                    for field, value in parse_replica_metrics(await resp.text()).items():
                        setattr(replica, field, value)
                    scraped = True
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.debug("scrape of %s failed: %r", replica.url, exc)
        replica.scraped = scraped
        try:
            async with self._session.get(f"{replica.url}/ready", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        was_healthy = replica.healthy
        if ok:
            replica.mark_success(self.config.healthy_after)
        else:
            replica.mark_failure(self.config.unhealthy_after)
        if replica.healthy != was_healthy:
            logger.info(
                "replica %s %s", replica.url, "back in rotation" if ok else "out of rotation"
            )
        return ok

    async def probe_all(self) -> None:
        """Probe every replica once, concurrently, then estimate the load of those whose
        scrape failed (`estimate_unscraped_load`)."""
        pools = list(self._pools())
        replicas = [r for pool in pools for r in pool.replicas]
        if replicas:
            await asyncio.gather(*(self.probe(r) for r in replicas))
        for pool in pools:
            estimate_unscraped_load(pool)

    async def _loop(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not stop health checking for good
                logger.exception("health probe round failed")
            await asyncio.sleep(self.config.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
