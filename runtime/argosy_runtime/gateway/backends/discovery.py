"""Discovery: what keeps a model's pool of replicas current."""

from __future__ import annotations

from typing import Protocol

import aiohttp

from argosy_runtime.gateway.backends.kubernetes import KubernetesDiscovery
from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.backends.static import StaticDiscovery
from argosy_runtime.gateway.config import ModelRouteConfig


class Discovery(Protocol):
    """Started with the gateway, stopped with it; updates `pool` in between."""

    pool: ReplicaPool

    def start(self) -> None: ...

    async def stop(self) -> None: ...


def make_discovery(
    route: ModelRouteConfig, pool: ReplicaPool, session: aiohttp.ClientSession
) -> Discovery:
    """Static list when the route has `backends`, else Kubernetes discovery."""
    if route.kubernetes is not None:
        return KubernetesDiscovery(pool, route.kubernetes, session)
    return StaticDiscovery(pool, route.backends)
