"""Adapter affinity: send a LoRA adapter's request where the adapter is already in memory.

A replica started with --max-loaded-loras serves more adapters than it keeps loaded. A
request for one it has only registered waits for the weights to be read (from disk, the Hub
or S3) and may evict another adapter that later requests must load again: the adapter's
analogue of a prefix-cache miss. So among the replicas serving the adapter, those listing it
in `argosy:lora_adapter_loaded` are preferred while they are within the same bounded load
prefix affinity uses (bounded_load.py).

When none of them is (the adapter is loaded nowhere yet, the loaded replicas are past the
bound, or the last scrape is older than the load), a replica that has it only registered must
load it. Which one is decided by the adapter's name, by rendezvous hashing over the replicas
within the bound: left to a load-balancing policy, an adapter's requests would land on every
replica in turn, each would load it and evict another adapter (thrash with small caps).
Hashing sends one adapter to one replica, which then lists it loaded and keeps it, while
different adapters spread over the replicas; only past the bound does a second replica load
it, as a hot prefix spills onto a second replica and is cached there too.
"""

from __future__ import annotations

from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.policies.bounded_load import capacity, within_bound
from argosy_runtime.gateway.policies.hashing import rendezvous_order


class AdapterAffinityPolicy(Policy):
    """Narrows an adapter request's candidates to the replicas with it loaded and within
    their bound, else to the adapter's home among those without it loaded (the first within
    the bound in its rendezvous order), then lets `inner` pick among them.

    Requests for a base model, adapters every candidate lists as loaded, and (rarely) ones
    with no candidate within the bound go to `inner` unchanged.
    """

    def __init__(self, inner: Policy, routing: RoutingConfig | None = None) -> None:
        self.inner = inner
        self.routing = routing or RoutingConfig()
        self.name = inner.name

    def preferred(self, candidates: Sequence[Replica], adapter: str) -> Sequence[Replica]:
        """The candidates to choose among for a request naming `adapter`."""
        loaded = [c for c in candidates if c.has_adapter_loaded(adapter)]
        if len(loaded) == len(candidates):
            return candidates
        # The bound counts every candidate's load, so a loaded replica gives way only when it
        # is well above the average of all the replicas that could serve the request.
        cap = capacity(candidates, self.routing)
        within = [c for c in loaded if within_bound(c, cap, self.routing)]
        if within:
            return within
        # A replica must load it: the same one for every request naming it, so the load is
        # paid once rather than once per replica.
        unloaded = [c for c in candidates if not c.has_adapter_loaded(adapter)]
        home = self.home(unloaded, adapter, cap)
        return [home] if home is not None else unloaded

    def home(self, replicas: Sequence[Replica], adapter: str, cap: int) -> Replica | None:
        """The first of `replicas` within `cap` in `adapter`'s rendezvous order, or None."""
        by_url = {r.url: r for r in replicas}
        for url in rendezvous_order(adapter, list(by_url)):
            if within_bound(by_url[url], cap, self.routing):
                return by_url[url]
        return None

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if request.adapter is not None:
            candidates = self.preferred(candidates, request.adapter)
        return self.inner.choose(candidates, request)
