"""A fixed list of replica URLs (from the config, flags, or the local fleet)."""

from __future__ import annotations

from collections.abc import Iterable

from argosy_runtime.gateway.backends.pool import ReplicaPool


class StaticDiscovery:
    """Puts a fixed URL list into the pool. The local fleet changes membership itself through
    `ReplicaPool.add` / `remove`, so nothing here needs to run in the background."""

    def __init__(self, pool: ReplicaPool, urls: Iterable[str]) -> None:
        self.pool = pool
        self.urls = list(urls)
        self.pool.set_urls(self.urls)

    def start(self) -> None:
        """Nothing to refresh."""

    async def stop(self) -> None:
        """Nothing to stop."""
