"""Bounded load: how far routing may favour a replica for what it has cached.

Prefix affinity (a prompt's KV blocks) and adapter affinity (a LoRA adapter's weights in
memory) both send a request to a replica that makes it cheaper, but only while that replica
is not much busier than the rest. Both use the one bound of Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads" (2018): at most ceil(c * (total + 1) / n) in-flight
requests per replica, never below `min_capacity`, and not at or above the KV high-watermark.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.config import RoutingConfig


def capacity(candidates: Sequence[Replica], routing: RoutingConfig) -> int:
    """Most in-flight requests one of `candidates` may hold, counting the one being placed."""
    total = sum(c.in_flight for c in candidates) + 1
    # Rounded before the ceil: the float product overshoots integers now and then (1.1 * 50 / 5
    # is 11.000000000000002), and its ceil would let a replica one request past the bound.
    bound = math.ceil(round(routing.load_factor * total / len(candidates), 9))
    return max(routing.min_capacity, bound)


def within_bound(replica: Replica, cap: int, routing: RoutingConfig) -> bool:
    """Whether `replica` may take one more request under `cap` (from `capacity`)."""
    return replica.in_flight < cap and replica.kv_cache_usage < routing.kv_high_watermark
