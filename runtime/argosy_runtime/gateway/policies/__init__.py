"""Routing policies: which replica of a model serves a request."""

from __future__ import annotations

from argosy_runtime.gateway.config import RoutingConfig
from argosy_runtime.gateway.policies.adapter_affinity import AdapterAffinityPolicy
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.policies.least_load import LeastLoadPolicy
from argosy_runtime.gateway.policies.prefix_affinity import PrefixAffinityPolicy
from argosy_runtime.gateway.policies.round_robin import RoundRobinPolicy

__all__ = [
    "AdapterAffinityPolicy",
    "LeastLoadPolicy",
    "Policy",
    "PrefixAffinityPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "make_policy",
]


def make_policy(name: str, routing: RoutingConfig | None = None,
                previous: Policy | None = None) -> Policy:
    """Build the policy called `name` ("round-robin", "least-load", "prefix-affinity"), which
    sends a LoRA adapter's requests to replicas with the adapter loaded first (within bounds),
    unless `routing.adapter_affinity` is off. `previous`: the policy it replaces when the
    routing settings are reloaded, whose learned state it takes over where that still holds
    (`Policy.adopt`)."""
    routing = routing or RoutingConfig()
    policy: Policy
    if name == "round-robin":
        policy = RoundRobinPolicy()
    elif name == "least-load":
        policy = LeastLoadPolicy(routing)
    elif name == "prefix-affinity":
        policy = PrefixAffinityPolicy(routing, fallback=LeastLoadPolicy(routing))
    else:
        raise ValueError(f"policy: unknown routing policy {name!r}")
    if previous is not None:
        policy.adopt(previous.inner if isinstance(previous, AdapterAffinityPolicy) else previous)
    if not routing.adapter_affinity:
        return policy
    wrapped = AdapterAffinityPolicy(policy, routing)
    if previous is not None:
        wrapped.adopt(previous)
    return wrapped
