"""Prometheus metrics of one runtime replica, named like vLLM's with the `argosy:` prefix.

Gauges and counters that the engine already keeps (running/waiting requests, KV-cache usage,
token and prefix-cache counters) are read from the newest `EngineStats` snapshot at scrape
time by a custom collector, so they are never stale by more than one engine step. Latency
histograms (TTFT, inter-token, end-to-end, queue time) are observed per request by
`AsyncEngine` through the `RequestObserver` methods below.

The gateway reads `argosy:kv_cache_usage_perc` and `argosy:num_requests_waiting`, and the
operator's autoscaler scrapes the same names: they are a public interface (DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from argosy_runtime.outputs import EngineStats
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    """Emits the engine's gauges and counters from the newest snapshot at scrape time."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats],
                 get_waiting: Callable[[], int], cache_info: dict[str, str],
                 get_adapters: Callable[[], Iterable[str]],
                 get_registered: Callable[[], Iterable[str]],
                 get_adapter_loads: Callable[[], int],
                 is_alive: Callable[[], bool]) -> None:
        self.model_name = model_name
        self.is_alive = is_alive
        self.get_stats = get_stats
        self.get_waiting = get_waiting
        self.cache_info = cache_info
        self.get_adapters = get_adapters
        self.get_registered = get_registered
        self.get_adapter_loads = get_adapter_loads

    def collect(self) -> Iterator[Metric]:
        s = self.get_stats()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"argosy:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"argosy:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        # A dead engine's last snapshot is not its load: the gauges are left out rather than
        # frozen at whatever they were (until the readiness probe fails, the autoscaler still
        # scrapes the pod; without them it counts the replica as fully loaded).
        if self.is_alive():
            yield gauge("num_requests_running", "Requests in the running batch.",
                        s.num_requests_running)
            yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                        self.get_waiting())
            yield gauge("kv_cache_usage_perc", "KV-cache usage, 0 to 1 (1 = full).",
                        s.kv_cache_usage)
        yield counter("prompt_tokens", "Prompt tokens processed.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted: for lack of KV blocks, or by "
                      "a request of higher priority.", s.num_preemptions)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      s.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.spec_decode_num_accepted_tokens)
        # Each one read weights and, at the --max-loaded-loras cap, evicted another adapter:
        # how often a replica's adapters thrash.
        yield counter("lora_adapter_loads", "LoRA adapters loaded by a request naming one "
                      "(--max-loaded-loras); not those loaded at start-up.",
                      self.get_adapter_loads())
        info = GaugeMetricFamily("argosy:cache_config_info", "KV-cache configuration.",
                                 labels=sorted(self.cache_info))
        info.add_metric([self.cache_info[k] for k in sorted(self.cache_info)], 1.0)
        yield info
        # One series per LoRA adapter in memory now, and one per adapter served (loaded on
        # first use with --max-loaded-loras): the gateway routes an adapter's requests to the
        # replicas that list it registered (adapters can come and go while a replica runs).
        for family, help_text, names in (
            ("argosy:lora_adapter_loaded",
             "1 for each LoRA adapter this server holds in memory now.", self.get_adapters()),
            ("argosy:lora_adapter_registered", "1 for each LoRA adapter this server serves, "
             "loaded or loaded by its first request (--max-loaded-loras).",
             self.get_registered()),
        ):
            adapters = GaugeMetricFamily(family, help_text, labels=["model_name", "lora_name"])
            for name in sorted(names):
                adapters.add_metric([self.model_name, name], 1.0)
            yield adapters


# The `path` label of argosy:http_requests: route templates, so ids never become series.
_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/tokenize",
    "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/files", "/v1/files/{id}",
    "/v1/files/{id}/content", "/v1/batches", "/v1/batches/{id}", "/v1/batches/{id}/cancel",
    "/v1/responses", "/v1/responses/{id}", "/v1/responses/{id}/input_items",
    "/v1/responses/{id}/cancel", "/v1/embeddings", "/v1/score", "/score", "/v1/rerank",
    "/rerank", "/v2/rerank", "/v1/classify", "/classify",
    "/health", "/ready", "/metrics"})


def route_label(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"  # a model id may hold slashes
    parts = path.split("/")
    if len(parts) >= 4 and parts[1] == "v1" and parts[2] in ("files", "batches", "responses"):
        parts[3] = "{id}"
    label = "/".join(parts)
    return label if label in _ROUTES else "other"


class ServerMetrics:
    """The registry of one server; implements `async_engine.RequestObserver`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        lab = ["model_name"]
        self.ttft = Histogram("argosy:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", lab,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("argosy:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.", lab,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("argosy:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", lab,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.queue = Histogram("argosy:request_queue_time_seconds",
                               "Time from arrival to first scheduling.", lab,
                               buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("argosy:request_success", "Requests that finished.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._http = Counter("argosy:http_requests", "HTTP responses by route and status.",
                             ["model_name", "path", "status"], registry=self.registry)
        self.batch_pending = Gauge("argosy:batch_requests_pending",
                                   "Requests of unfinished Batch API jobs not answered yet.",
                                   lab, registry=self.registry).labels(model_name)
        self.rejected = Counter("argosy:request_rejected",
                                "Requests refused before reaching the engine.",
                                ["model_name", "reason"], registry=self.registry)

    def attach_engine(self, get_stats: Callable[[], EngineStats],
                      get_waiting: Callable[[], int], cache_info: dict[str, str],
                      get_adapters: Callable[[], Iterable[str]] = tuple,
                      get_registered: Callable[[], Iterable[str]] | None = None,
                      get_adapter_loads: Callable[[], int] = lambda: 0,
                      is_alive: Callable[[], bool] = lambda: True) -> None:
        """`get_adapters`: the LoRA adapters in memory; `get_registered`: every adapter
        served (default: the same, as without --max-loaded-loras); `get_adapter_loads`: how
        many adapters requests have loaded so far; `is_alive`: whether the engine runs (the
        load gauges are exported only then)."""
        self.registry.register(_EngineStatsCollector(self.model_name, get_stats, get_waiting,
                                                     cache_info, get_adapters,
                                                     get_registered or get_adapters,
                                                     get_adapter_loads, is_alive))

    # RequestObserver (called from the engine thread; prometheus_client is thread-safe)
    def on_scheduled(self, queue_time_s: float) -> None:
        self.queue.observe(queue_time_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, gap_s: float, num_tokens: int) -> None:
        # Several tokens of one sequence in one step (speculative decoding) share its gap.
        per_token = gap_s / max(num_tokens, 1)
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def on_finished(self, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int,
                    finish_reason: str | None) -> None:
        # The latency of an answer: a request aborted (its client gone) or failed has none.
        if finish_reason not in ("abort", "error"):
            self.e2e.observe(e2e_s)
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def on_http(self, path: str, status: int) -> None:
        self._http.labels(self.model_name, route_label(path), str(status)).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
