"""The health checker's /metrics parser against the pages runtime replicas really serve."""

from __future__ import annotations

from argosy_runtime.gateway.health import parse_replica_metrics
from argosy_runtime.outputs import EngineStats
from argosy_runtime.server.metrics import ServerMetrics


def replica_page(loaded: list[str], registered: list[str] | None = None) -> str:
    """A runtime server's /metrics text: `loaded` adapters in memory, `registered` served
    (None: the same, as without --max-loaded-loras)."""
    metrics = ServerMetrics("tiny")
    stats = EngineStats(num_requests_running=2, num_requests_waiting=3, kv_cache_usage=0.5)
    metrics.attach_engine(
        lambda: stats, lambda: 3, {"block_size": "16"}, lambda: loaded,
        None if registered is None else (lambda: registered),
    )
    return metrics.render().decode()


def test_parse_reads_loaded_and_registered_adapters_apart() -> None:
    found = parse_replica_metrics(replica_page(loaded=["sql"], registered=["sql", "chat"]))
    assert found["adapters"] == {"sql", "chat"}  # routable: served, loaded or not
    assert found["loaded_adapters"] == {"sql"}  # preferred: no load on the request's path
    assert (found["num_running"], found["num_waiting"], found["kv_cache_usage"]) == (2, 3, 0.5)


def test_parse_without_a_loaded_cap_or_adapters() -> None:
    found = parse_replica_metrics(replica_page(loaded=["sql"]))
    assert found["adapters"] == found["loaded_adapters"] == {"sql"}
    found = parse_replica_metrics(replica_page(loaded=[]))
    assert found["adapters"] == found["loaded_adapters"] == frozenset()


def test_parse_a_replica_exporting_only_the_loaded_family() -> None:
    """Servers from before --max-loaded-loras: every adapter they serve is loaded."""
    page = (
        "# TYPE argosy:lora_adapter_loaded gauge\n"
        'argosy:lora_adapter_loaded{model_name="tiny",lora_name="sql"} 1.0\n'
        'argosy:lora_adapter_loaded{model_name="tiny",lora_name="gone"} 0.0\n'
    )
    found = parse_replica_metrics(page)
    assert found["adapters"] == found["loaded_adapters"] == {"sql"}
    # A server without LoRA metrics at all says nothing (the gateway assumes it may serve).
    assert "adapters" not in parse_replica_metrics("# TYPE x gauge\nx 1\n")


def test_parse_skips_samples_that_are_not_finite() -> None:
    """NaN and infinities say nothing about a replica's load (routing compares the numbers)."""
    page = ("argosy:kv_cache_usage_perc NaN\nargosy:num_requests_waiting +Inf\n"
            'argosy:num_requests_running{a="1"} 2\nargosy:num_requests_running{a="2"} -Inf\n')
    assert parse_replica_metrics(page) == {"num_running": 2.0}
