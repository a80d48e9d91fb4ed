"""Routing policies: which replica of a model serves a request."""

from __future__ import annotations

from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.policies.least_load import LeastLoadPolicy
from argosy_runtime.gateway.policies.prefix_affinity import PrefixAffinityPolicy
from argosy_runtime.gateway.policies.round_robin import RoundRobinPolicy

__all__ = [
    "LeastLoadPolicy",
    "Policy",
    "PrefixAffinityPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "make_policy",
]


def make_policy(name: str, routing: RoutingConfig | None = None) -> Policy:
    """Build the policy called `name` ("round-robin", "least-load", "prefix-affinity")."""
    routing = routing or RoutingConfig()
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-load":
        return LeastLoadPolicy(routing)
    if name == "prefix-affinity":
        return PrefixAffinityPolicy(routing, fallback=LeastLoadPolicy(routing))
    raise ValueError(f"policy: unknown routing policy {name!r}")
