"""One runtime replica as the gateway sees it: its URL, load and health."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Replica:
    """Mutable state of one replica, updated by the proxy (in-flight, passive failures) and
    the health checker (scraped metrics, probes)."""

    url: str
    # Requests this gateway has sent and not yet finished (the only load signal that is exact).
    in_flight: int = 0
    # Last scraped gauges from the replica's /metrics (while its scrape fails, the health
    # checker's estimate: health.estimate_unscraped_load).
    kv_cache_usage: float = 0.0
    num_waiting: float = 0.0
    num_running: float = 0.0
    # Batch API requests the replica holds and has not answered (they cannot move elsewhere).
    batch_pending: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # Requests the replica has finished since it started: one served between two scrapes
    # moves it, where the gauges above never show the request (the fleet's autoscaler
    # then does not take the replica for idle).
    num_finished: float = 0.0
    # LoRA adapters the replica serves now, loaded or loaded on first use
    # (`argosy:lora_adapter_loaded` and `argosy:lora_adapter_registered`); None when its
    # metrics do not say (not scraped yet, or a server that does not export them).
    adapters: frozenset[str] | None = None
    # The subset of `adapters` in memory now (`argosy:lora_adapter_loaded`): a request for
    # one of these skips the load that a registered-only adapter pays on first use.
    loaded_adapters: frozenset[str] | None = None
    # Whether the last /metrics scrape succeeded (the gauges above are stale when not).
    scraped: bool = False
    # Out of rotation when False; the health checker probes it back.
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # monotonic time before which the replica asked not to be sent anything (Retry-After).
    cooldown_until: float = 0.0

    def is_available(self, now: float | None = None) -> bool:
        """In rotation: healthy and not inside a Retry-After window."""
        now = time.monotonic() if now is None else now
        return self.healthy and now >= self.cooldown_until

    def may_serve_adapter(self, name: str) -> bool:
        """False only when the replica's metrics list its adapters and `name` is not one."""
        return self.adapters is None or name in self.adapters

    def has_adapter_loaded(self, name: str) -> bool:
        """True only when the replica's metrics list `name` as in memory now."""
        return self.loaded_adapters is not None and name in self.loaded_adapters

    def set_retry_after(self, seconds: float) -> None:
        """Honour a `Retry-After`: send nothing to this replica for `seconds`."""
        self.cooldown_until = max(self.cooldown_until, time.monotonic() + max(0.0, seconds))

    def mark_failure(self, threshold: int) -> None:
        """Count one failed probe or request; out of rotation after `threshold` in a row."""
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        if self.consecutive_failures >= threshold:
            self.healthy = False

    def mark_success(self, threshold: int) -> None:
        """Count one successful probe; back in rotation after `threshold` in a row."""
        self.consecutive_failures = 0
        self.consecutive_successes += 1
        if not self.healthy and self.consecutive_successes >= threshold:
            self.healthy = True
