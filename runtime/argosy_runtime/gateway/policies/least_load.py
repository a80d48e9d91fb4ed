"""Least-load: the replica with the lowest load score."""

from __future__ import annotations

from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest


class LeastLoadPolicy(Policy):
    """Pick the replica with the smallest

        w_in_flight * in_flight + w_waiting * num_requests_waiting + w_kv * kv_cache_usage_perc

    `in_flight` is the gateway's own exact count; the other two are scraped from the replica's
    /metrics (a few seconds stale, but they see load from other gateways and the KV pressure
    that in-flight counts cannot). Ties rotate, so equal replicas share the work.
    """

    name = "least-load"

    def __init__(self, routing: RoutingConfig | None = None) -> None:
        self.routing = routing or RoutingConfig()
        self._tie = 0

    def score(self, replica: Replica) -> float:
        """Lower is better."""
        r = self.routing
        return (
            r.w_in_flight * replica.in_flight
            + r.w_waiting * replica.num_waiting
            + r.w_kv * replica.kv_cache_usage
        )

    def adopt(self, previous: Policy) -> None:
        if isinstance(previous, LeastLoadPolicy):
            self._tie = previous._tie  # ties keep rotating where they were

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if not candidates:
            return None
        scores = [self.score(c) for c in candidates]
        best = min(scores)
        # `s <= best + eps`, not `s - best < eps`: were scores ever inf (config bounds the
        # weights, the health checker drops non-finite gauges, so only absurd finite gauges
        # could do it), inf - inf is NaN and no replica would tie, not even the best.
        tied = [c for c, s in zip(candidates, scores, strict=True) if s <= best + 1e-9]
        replica = tied[self._tie % len(tied)]
        self._tie += 1
        return replica
