"""Adapter affinity: send a LoRA adapter's request where the adapter is already in memory.

A replica started with --max-loaded-loras serves more adapters than it keeps loaded. A
request for one it has only registered waits for the weights to be read (from disk, the Hub
or S3) and may evict another adapter that later requests must load again: the adapter's
analogue of a prefix-cache miss. So among the replicas serving the adapter, those listing it
in `argosy:lora_adapter_loaded` are preferred while they are within the same bounded load
prefix affinity uses (bounded_load.py); past it, the request goes to the replicas that have
the adapter only registered, and the one picked loads it, as a hot prefix spills onto a second
replica and is cached there too.
"""

from __future__ import annotations

from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.policies.bounded_load import capacity, within_bound


class AdapterAffinityPolicy(Policy):
    """Narrows an adapter request's candidates to the replicas with it loaded and within
    their bound, else to those without it loaded, then lets `inner` pick among them.

    Requests for a base model, and adapters no candidate lists as loaded (every replica pays
    the load, or its metrics do not say), go to `inner` unchanged.
    """

    def __init__(self, inner: Policy, routing: RoutingConfig | None = None) -> None:
        self.inner = inner
        self.routing = routing or RoutingConfig()
        self.name = inner.name

    def preferred(self, candidates: Sequence[Replica], adapter: str) -> Sequence[Replica]:
        """The candidates to choose among for a request naming `adapter`."""
        loaded = [c for c in candidates if c.has_adapter_loaded(adapter)]
        if not loaded or len(loaded) == len(candidates):
            return candidates
        # The bound counts every candidate's load, so a loaded replica gives way only when it
        # is well above the average of all the replicas that could serve the request.
        cap = capacity(candidates, self.routing)
        within = [c for c in loaded if within_bound(c, cap, self.routing)]
        if within:
            return within
        # Every loaded one is far busier: paying the load beats queueing behind them.
        return [c for c in candidates if not c.has_adapter_loaded(adapter)]

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if request.adapter is not None:
            candidates = self.preferred(candidates, request.adapter)
        return self.inner.choose(candidates, request)
