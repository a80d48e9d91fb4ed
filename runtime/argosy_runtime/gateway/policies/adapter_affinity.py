"""Adapter affinity: send a LoRA adapter's request where the adapter is already in memory.

A replica started with --max-loaded-loras serves more adapters than it keeps loaded. A
request for one it has only registered waits for the weights to be read (from disk, the Hub
or S3) and may evict another adapter that later requests must load again: the adapter's
analogue of a prefix-cache miss. So among the replicas serving the adapter, those that hold it
are preferred while they are within the same bounded load prefix affinity uses
(bounded_load.py). A replica holds an adapter when its last scrape lists it in
`argosy:lora_adapter_loaded`, or when this gateway sent it a request for the adapter in the
last `recent_s` seconds: the scrape runs every few seconds, and until it shows the load the
gateway's own record is what keeps the adapter's next requests on the same replica.

When no holder is within the bound (a new adapter, holders past the bound), one replica must
load it, its home: the one within the bound that holds the fewest adapters, then has the
fewest requests in flight, ties broken by the adapter's rendezvous order. Left to a
load-balancing policy, an adapter's requests would land on every replica in turn, each would
load it and evict another adapter (thrash with small caps). Picking by name alone (rendezvous
hashing, the previous rule) keeps one adapter on one replica but splits a handful of adapters
unevenly (3 of 4 on one of 2 replicas), and that replica then thrashes while the other idles;
counting the adapters each replica holds spreads them evenly (2 and 2). Only past the bound
does a second replica load it, as a hot prefix spills onto a second replica.

The record is per gateway process: several gateways place a new adapter independently, each
one sticky, and after the next scrape all of them see where it was loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.policies.bounded_load import capacity, within_bound
from argosy_runtime.gateway.policies.hashing import rendezvous_order

# How long a request sent for an adapter counts as the replica holding it without the scrape
# saying so: 5 of the default 2 s health intervals, so a load shows in a scrape well before the
# record runs out; each request for the adapter renews it.
RECENT_S = 10.0


class AdapterAffinityPolicy(Policy):
    """Narrows an adapter request's candidates to the replicas holding it (scraped as loaded,
    or sent it recently) and within their bound, else to the adapter's home among the others
    (the least busy in adapters, then in requests), then lets `inner` pick among them.

    Requests for a base model, adapters every candidate holds, and (rarely) ones with no
    candidate within the bound go to `inner` unchanged.
    """

    def __init__(self, inner: Policy, routing: RoutingConfig | None = None, *,
                 recent_s: float = RECENT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.routing = routing or RoutingConfig()
        self.name = inner.name
        self.recent_s = recent_s
        self.clock = clock
        # adapter -> {replica URL: when this gateway last sent it a request for the adapter};
        # entries older than recent_s are dropped at each placement of a new home, so it holds
        # about the adapters in use, times the replicas each one is on.
        self.sent: dict[str, dict[str, float]] = {}

    def adopt(self, previous: Policy) -> None:
        """Keep the record of the policy these settings replace, whatever the inner policy
        was and is now: where this gateway just sent each adapter is where it is being
        loaded, which new settings do not change. (make_policy hands the inner policies
        over.)"""
        if isinstance(previous, AdapterAffinityPolicy):
            self.sent = previous.sent

    def holds(self, replica: Replica, adapter: str, now: float) -> bool:
        """Whether `replica` has `adapter` in memory, as far as this gateway knows."""
        if replica.has_adapter_loaded(adapter):
            return True
        sent_at = self.sent.get(adapter, {}).get(replica.url)
        return sent_at is not None and now - sent_at < self.recent_s

    def preferred(self, candidates: Sequence[Replica], adapter: str, now: float
                  ) -> Sequence[Replica]:
        """The candidates to choose among for a request naming `adapter`."""
        holders = [c for c in candidates if self.holds(c, adapter, now)]
        if len(holders) == len(candidates):
            return candidates
        # The bound counts every candidate's load, so a holder gives way only when it is well
        # above the average of all the replicas that could serve the request.
        cap = capacity(candidates, self.routing)
        within = [c for c in holders if within_bound(c, cap, self.routing)]
        if within:
            return within
        # A replica must load it: the same one for the requests that follow (it holds it from
        # now on), so the load is paid once rather than once per replica.
        others = [c for c in candidates if not self.holds(c, adapter, now)]
        home = self.home(others, adapter, cap, now)
        # No replica within the bound (only the KV high-watermark does that): all of them, as
        # for a base-model request; forcing a non-holder would add an adapter load (and an
        # eviction) on a replica no less full than the holders.
        return [home] if home is not None else candidates

    def home(self, replicas: Sequence[Replica], adapter: str, cap: int, now: float
             ) -> Replica | None:
        """Of `replicas` within `cap`, the one holding the fewest adapters, then with the
        fewest requests in flight, then first in `adapter`'s rendezvous order; or None."""
        within = [r for r in replicas if within_bound(r, cap, self.routing)]
        if not within:
            return None
        self.forget_old(now)
        held: dict[str, set[str]] = {r.url: set(r.loaded_adapters or ()) for r in within}
        for name, urls in self.sent.items():
            for url in urls:
                if url in held:
                    held[url].add(name)
        rank = {url: i for i, url in enumerate(rendezvous_order(adapter, list(held)))}
        return min(within, key=lambda r: (len(held[r.url]), r.in_flight, rank[r.url]))

    def forget_old(self, now: float) -> None:
        """Drop the sends older than recent_s."""
        for name in list(self.sent):
            urls = {u: t for u, t in self.sent[name].items() if now - t < self.recent_s}
            if urls:
                self.sent[name] = urls
            else:
                del self.sent[name]

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if request.adapter is None:
            return self.inner.choose(candidates, request)
        now = self.clock()
        chosen = self.inner.choose(self.preferred(candidates, request.adapter, now), request)
        if chosen is not None:
            self.sent.setdefault(request.adapter, {})[chosen.url] = now
        return chosen
