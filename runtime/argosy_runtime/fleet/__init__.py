"""The local fleet: runtime server processes on loopback ports, the gateway in front, and the
autoscaler's decision function starting and draining replicas. No Kubernetes, no torch here
(the replicas are separate processes)."""

from __future__ import annotations

from argosy_runtime.fleet.replica_process import ReplicaProcess, free_port
from argosy_runtime.fleet.supervisor import Fleet, FleetConfig

__all__ = ["Fleet", "FleetConfig", "ReplicaProcess", "free_port"]
