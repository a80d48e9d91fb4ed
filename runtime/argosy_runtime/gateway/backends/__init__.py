"""Replicas and where they come from: a static list or a Kubernetes LLMDeployment."""

from __future__ import annotations

from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.backends.replica import Replica

__all__ = ["Replica", "ReplicaPool"]
