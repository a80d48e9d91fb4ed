"""Prefix affinity: consistent hashing with bounded load on the leading part of the prompt.

Requests whose prompts start alike hash to the same point of a ring, so they land on the
replica whose prefix cache already holds that prefix's KV blocks. A plain hash would pile a
popular prefix onto one replica; bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
Hashing with Bounded Loads", 2018) cap each replica at ceil(c * (total + 1) / n) in-flight
requests (never below `min_capacity`) and walk the ring clockwise to the next replica with
room, so a hot prefix spills onto a second replica (which then caches it too) instead of
queueing.

The ring key is a fixed length (`prefix_chars`), but shared prefixes come in every length. So
the policy also keeps a bounded table: for each `block_chars` boundary of a prompt's leading
text, which replica last took it. A request goes to the replica holding its longest known
prefix when that replica is within its bound, and otherwise to the ring. Both parts are
deterministic given the same request history; the ring alone decides a cold prefix, so several
gateways agree on where a new prefix goes.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.policies.bounded_load import capacity, within_bound
from argosy_runtime.gateway.policies.hashing import hash64, utf8


def block_hashes(text: str, block_chars: int, salt: str = "") -> list[bytes]:
    """Digests of salt + text[:block_chars], salt + text[:2*block_chars], ... (whole blocks of
    `text` only; `salt` is a request's `routing_salt`).

    One running hash, copied at each boundary: O(len(text)), not O(len(text)^2 / block).
    """
    running = hashlib.blake2b(digest_size=16)
    running.update(utf8(salt))
    out = []
    for end in range(block_chars, len(text) + 1, block_chars):
        running.update(utf8(text[end - block_chars : end]))
        out.append(running.copy().digest())
    return out


def routing_salt(request: RouteRequest) -> str:
    """What goes in front of `request`'s prompt in every routing key ("" for a base-model
    request without tenants, salt or prompt_cache_key). Each part is length-prefixed, so two
    requests get the same salt only when all their parts are equal.

    - Its owner: replicas keep each tenant's prefix cache to itself (server.md, "Prefix cache
      per owner"), so one tenant's prompt never places another's request: if it did, the
      replica a request lands on (`x-argosy-backend`) would tell one tenant whether another
      had sent a prompt starting alike.
    - Its cache partition: a replica divides its prefix cache further (request.py,
      `cache_salt`) by LoRA adapter, whose K/V differ from the base model's, and by the
      client's own `cache_salt`. A prompt in one partition must not place a request of
      another, whose cached blocks are not the same.
    - Its `prompt_cache_key` (OpenAI's field): the client's word that requests with the same
      key belong together. Keyed, requests that share a long prefix (a system prompt every
      user sends) are spread over the replicas key by key instead of piling onto the one
      that first cached it, and each key's requests stay together, short prompts too.
    """
    parts = [request.owner, request.adapter, request.cache_salt, request.cache_key]
    if all(part is None for part in parts):
        return ""
    return "".join("-" if part is None else f"{len(part)}:{part}:" for part in parts)


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
    """Longest known prefix first, else consistent hashing with bounded load.

    Prompts shorter than `routing.min_prefix_chars` carry no useful prefix and go to the
    `fallback` policy (least-load by default), unless a `prompt_cache_key` places them; so do
    requests when every replica is over its bound, which only the KV high-watermark can
    cause (the in-flight bound always leaves room).
    """

    name = "prefix-affinity"

    def __init__(self, routing: RoutingConfig | None = None, fallback: Policy | None = None):
        self.routing = routing or RoutingConfig()
        self.fallback = fallback
        # A few rings, keyed by membership, so health flaps do not rebuild every time.
        self._rings: OrderedDict[frozenset[str], HashRing] = OrderedDict()
        # block-prefix digest -> URL of the replica that last took a prompt with that prefix
        self._affinity: OrderedDict[bytes, str] = OrderedDict()

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

    def adopt(self, previous: Policy) -> None:
        """Keep the prefix table of the policy these settings replace: it records where
        prompts went, which new settings do not change, and its keys digest a prompt's first
        k characters whatever `block_chars` cut them (one running hash), so every entry stays
        true; with a new `block_chars`, entries off the new boundaries just stop matching and
        age out. A smaller `affinity_entries` drops the oldest at once. The rings are kept
        only when `virtual_nodes` is unchanged (a ring is built for one count)."""
        if not isinstance(previous, PrefixAffinityPolicy):
            return
        self._affinity = previous._affinity
        self._trim()
        if previous.routing.virtual_nodes == self.routing.virtual_nodes:
            self._rings = previous._rings
        if self.fallback is not None and previous.fallback is not None:
            self.fallback.adopt(previous.fallback)

    def capacity(self, candidates: Sequence[Replica]) -> int:
        """Most in-flight requests one replica may hold, counting the one being placed."""
        return capacity(candidates, self.routing)

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if not candidates:
            return None
        text = request.prefix[: self.routing.max_prefix_chars]
        if len(text) < self.routing.min_prefix_chars and request.cache_key is None:
            return self._fallback(candidates, request)
        by_url = {c.url: c for c in candidates}
        cap = self.capacity(candidates)
        salt = routing_salt(request)
        hashes = block_hashes(text, self.routing.block_chars, salt)
        chosen: Replica | None = None
        for digest in reversed(hashes):  # longest known prefix first
            url = self._affinity.get(digest)
            if url is not None and url in by_url:
                if within_bound(by_url[url], cap, self.routing):
                    chosen = by_url[url]
                break  # shorter prefixes of the same prompt live on the same replica or older
        if chosen is None:
            # A prompt_cache_key alone places its requests: the key says they belong
            # together, however their prompts start.
            key = salt + ("" if request.cache_key is not None
                          else text[: self.routing.prefix_chars])
            for url in self.ring(list(by_url)).walk(key):
                if within_bound(by_url[url], cap, self.routing):
                    chosen = by_url[url]
                    break
        if chosen is None:
            return self._fallback(candidates, request)
        self._remember(hashes, chosen.url)
        return chosen

    def _remember(self, hashes: list[bytes], url: str) -> None:
        table = self._affinity
        for digest in hashes:
            table[digest] = url
            table.move_to_end(digest)
        self._trim()

    def _trim(self) -> None:
        """Drop the least recently used entries past `affinity_entries`."""
        table = self._affinity
        while len(table) > self.routing.affinity_entries:
            table.popitem(last=False)

    def _fallback(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if self.fallback is not None:
            return self.fallback.choose(candidates, request)
        return min(candidates, key=lambda c: c.in_flight)
