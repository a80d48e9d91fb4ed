"""The gateway's own Prometheus metrics (served on its /metrics).

Each gateway owns a CollectorRegistry, so several gateways in one process (tests, the fleet's
side-by-side benchmark) never share counters. Per-replica state (in-flight, health, the
scraped KV usage and prefix-cache counters) is read from the pools at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from argosy_runtime.gateway.activation import Activator
from argosy_runtime.gateway.backends.pool import ReplicaPool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _ReplicaCollector(Collector):
    def __init__(
        self,
        pools: Callable[[], Iterable[ReplicaPool]],
        activators: Callable[[], Iterable[Activator]],
    ) -> None:
        self._pools = pools
        self._activators = activators

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["model", "backend"]
        families = {
            "in_flight": GaugeMetricFamily(
                "argosy:gateway_backend_in_flight", "Requests in flight per replica.", labels=labels
            ),
            "healthy": GaugeMetricFamily(
                "argosy:gateway_backend_healthy", "1 when the replica is in rotation.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "argosy:gateway_backend_kv_cache_usage_perc",
                "KV-cache usage last scraped from the replica (0..1).",
                labels=labels,
            ),
            "waiting": GaugeMetricFamily(
                "argosy:gateway_backend_num_requests_waiting",
                "Waiting requests last scraped from the replica.",
                labels=labels,
            ),
            "queries": GaugeMetricFamily(
                "argosy:gateway_backend_prefix_cache_queries",
                "argosy:prefix_cache_queries_total last scraped from the replica.",
                labels=labels,
            ),
            "hits": GaugeMetricFamily(
                "argosy:gateway_backend_prefix_cache_hits",
                "argosy:prefix_cache_hits_total last scraped from the replica.",
                labels=labels,
            ),
        }
        for pool in self._pools():
            for r in pool.replicas:
                key = [pool.model, r.url]
                families["in_flight"].add_metric(key, r.in_flight)
                families["healthy"].add_metric(key, 1.0 if r.is_available() else 0.0)
                families["kv"].add_metric(key, r.kv_cache_usage)
                families["waiting"].add_metric(key, r.num_waiting)
                families["queries"].add_metric(key, r.prefix_cache_queries)
                families["hits"].add_metric(key, r.prefix_cache_hits)
        yield from families.values()
        held = GaugeMetricFamily(
            "argosy:gateway_requests_held",
            "Requests waiting for a replica of a model that has none (scale from zero).",
            labels=["model"],
        )
        for activator in self._activators():
            held.add_metric([activator.pool.model], activator.held)
        yield held


class GatewayMetrics:
    """Counters and histograms the proxy updates, plus the per-replica gauges."""

    def __init__(
        self,
        pools: Callable[[], Iterable[ReplicaPool]],
        activators: Callable[[], Iterable[Activator]] = list,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "argosy:gateway_requests",
            "Requests answered, by model, replica and HTTP status (499: the client went away "
            "before the answer ended; 502 after a 200: the replica broke mid-answer).",
            ["model", "backend", "code"],
            registry=r,
        )
        self.retries = Counter(
            "argosy:gateway_retries",
            "Tries that failed before the first byte, by reason (each is re-sent to another "
            "replica while tries remain).",
            ["model", "reason"],
            registry=r,
        )
        self.cascade_decisions = Counter(
            "argosy:gateway_cascade_decisions",
            "Cascade decisions, by route, chosen tier and rule.",
            ["route", "tier", "reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "argosy:gateway_client_disconnects",
            "Requests whose client went away before the answer ended.",
            ["model"],
            registry=r,
        )
        self.latency = Histogram(
            "argosy:gateway_request_latency_seconds",
            "Time from request to the last byte of the answer.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "argosy:gateway_time_to_first_byte_seconds",
            "Time from request to the first byte of the answer's body.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.activation_wait = Histogram(
            "argosy:gateway_activation_wait_seconds",
            "Time a request was held until a replica of its model came into rotation (the cold "
            "start a client saw after scale-to-zero).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.activation_timeouts = Counter(
            "argosy:gateway_activation_timeouts",
            "Held requests answered 503 because no replica came within activation.timeout_s.",
            ["model"],
            registry=r,
        )
        # Per tenant (docs/gateway.md, "Tenants and rate limits"); never a label per key.
        self.tenant_requests = Counter(
            "argosy:gateway_tenant_requests",
            "Requests of each tenant, by HTTP status (429: over a limit; 499: the client went "
            "away before the answer).",
            ["tenant", "code"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "argosy:gateway_tenant_tokens",
            "Tokens charged to each tenant (the answers' usage, else the gateway's estimate).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_rate_limited = Counter(
            "argosy:gateway_tenant_rate_limited",
            "Requests refused with 429 because the tenant was over a limit, by limit.",
            ["tenant", "limit"],
            registry=r,
        )
        self.config_reload_failures = Counter(
            "argosy:gateway_config_reload_failures",
            "Changes to the config file that could not apply (unreadable, invalid): the "
            "gateway kept its previous tenants and routing. Each problem counts once.",
            registry=r,
        )
        self.config_refused = Gauge(
            "argosy:gateway_config_refused",
            "1 while the config file on disk is refused (unreadable, invalid) and the gateway "
            "serves its previous tenants and routing; 0 once a valid file applies.",
            registry=r,
        )
        r.register(_ReplicaCollector(pools, activators))

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
