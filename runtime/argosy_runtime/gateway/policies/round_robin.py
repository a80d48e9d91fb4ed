"""Round-robin: each replica in turn, ignoring load and prompt."""

from __future__ import annotations

from collections.abc import Sequence

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.policies.base import Policy, RouteRequest


class RoundRobinPolicy(Policy):
    """Cycle through the candidates in URL order.

    The cursor is a counter taken modulo the number of candidates, so replicas leaving or
    joining rotation shift the cycle but never starve anyone.
    """

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def adopt(self, previous: Policy) -> None:
        if isinstance(previous, RoundRobinPolicy):
            self._next = previous._next  # the cycle goes on where it was

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        if not candidates:
            return None
        replica = candidates[self._next % len(candidates)]
        self._next += 1
        return replica
