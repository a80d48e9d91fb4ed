"""Prefix affinity: consistent hashing with bounded load on the leading part of the prompt.

Requests whose prompts start alike hash to the same point of a ring, so they land on the
replica whose prefix cache already holds that prefix's KV blocks. A plain hash would pile a
popular prefix onto one replica; bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
Hashing with Bounded Loads", 2018) cap each replica at ceil(c * (total + 1) / n) in-flight
requests and walk the ring clockwise to the next replica with room, so a hot prefix spills onto
a second replica (which then caches it too) instead of queueing.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest


def hash64(text: str) -> int:
    """A stable 64-bit hash (Python's hash() is salted per process; rings must agree across
    gateway restarts and replicas of the gateway)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """`virtual_nodes` points per member on a 64-bit ring.

    Many points per member even out the arc lengths, so each member owns close to 1/n of the
    keys; adding or removing a member moves only the keys on its own arcs.
    """

    def __init__(self, members: Sequence[str], virtual_nodes: int) -> None:
        points = sorted(
            (hash64(f"{member}#{i}"), member) for member in members for i in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._members = [m for _, m in points]
        self.num_members = len(set(members))

    def walk(self, key: str) -> list[str]:
        """Distinct members in clockwise order from the key's point (the preference list)."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, hash64(key))
        order: list[str] = []
        seen: set[str] = set()
        n = len(self._members)
        for i in range(n):
            member = self._members[(start + i) % n]
            if member not in seen:
                seen.add(member)
                order.append(member)
                if len(order) == self.num_members:
                    break
        return order

    def owner(self, key: str) -> str | None:
        """The first member clockwise from the key (no load bound)."""
        order = self.walk(key)
        return order[0] if order else None


class PrefixAffinityPolicy(Policy):
    """Consistent hashing with bounded load on `RouteRequest.prefix`.

    Prompts shorter than `routing.min_prefix_chars` carry no useful prefix and go to the
    `fallback` policy (least-load by default); so do requests when every replica is over its
    bound, which only the KV high-watermark can cause (the in-flight bound always leaves room).
    """

    name = "prefix-affinity"

    def __init__(self, routing: RoutingConfig | None = None, fallback: Policy | None = None):
        self.routing = routing or RoutingConfig()
        self.fallback = fallback
        # A few rings, keyed by membership, so health flaps do not rebuild every time.
        self._rings: OrderedDict[frozenset[str], HashRing] = OrderedDict()

    def ring(self, members: Sequence[str]) -> HashRing:
        key = frozenset(members)
        ring = self._rings.get(key)
        if ring is None:
            ring = HashRing(sorted(key), self.routing.virtual_nodes)
            self._rings[key] = ring
            while len(self._rings) > 8:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring

    def capacity(self, candidates: Sequence[Replica]) -> int:
        """Most in-flight requests one replica may hold, counting the one being placed."""
        total = sum(c.in_flight for c in candidates) + 1
        bound = math.ceil(self.routing.load_factor * total / len(candidates))
        return max(self.routing.min_capacity, bound)

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if not candidates:
            return None
        key = request.prefix[: self.routing.prefix_chars]
        if len(key) < self.routing.min_prefix_chars:
            return self._fallback(candidates, request)
        by_url = {c.url: c for c in candidates}
        cap = self.capacity(candidates)
        for url in self.ring(list(by_url)).walk(key):
            replica = by_url[url]
            if replica.in_flight < cap and replica.kv_cache_usage < self.routing.kv_high_watermark:
                return replica
        return self._fallback(candidates, request)

    def _fallback(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if self.fallback is not None:
            return self.fallback.choose(candidates, request)
        return min(candidates, key=lambda c: c.in_flight)
