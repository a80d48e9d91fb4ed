"""The replicas of one model name, kept in step with discovery."""

from __future__ import annotations

import time
from collections.abc import Iterable

from argosy_runtime.gateway.backends.replica import Replica


class ReplicaPool:
    """The set of replicas serving one model.

    Discovery calls `set_urls` whenever the membership changes; state of replicas that stay
    (in-flight counts, health) is kept, so a refresh never resets load accounting.
    """

    def __init__(self, model: str, urls: Iterable[str] = ()) -> None:
        self.model = model
        self._replicas: dict[str, Replica] = {}
        self.version = 0  # bumped on every membership change
        self.set_urls(urls)

    def set_urls(self, urls: Iterable[str]) -> bool:
        """Replace the membership; returns True when it changed."""
        wanted = [u.rstrip("/") for u in urls]
        if set(wanted) == set(self._replicas):
            return False
        self._replicas = {u: self._replicas.get(u) or Replica(url=u) for u in wanted}
        self.version += 1
        return True

    def add(self, url: str) -> Replica:
        """Add one replica (no-op when present)."""
        url = url.rstrip("/")
        if url not in self._replicas:
            self.set_urls([*self._replicas, url])
        return self._replicas[url]

    def remove(self, url: str) -> None:
        """Remove one replica (no-op when absent)."""
        url = url.rstrip("/")
        if url in self._replicas:
            self.set_urls([u for u in self._replicas if u != url])

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url.rstrip("/"))

    @property
    def replicas(self) -> list[Replica]:
        """All members, in a stable order (by URL)."""
        return [self._replicas[u] for u in sorted(self._replicas)]

    def available(self, exclude: Iterable[str] = ()) -> list[Replica]:
        """Members in rotation, minus `exclude` (URLs already tried for this request)."""
        skip = set(exclude)
        now = time.monotonic()
        return [r for r in self.replicas if r.url not in skip and r.is_available(now)]

    def earliest_retry_after(self) -> float | None:
        """Seconds until the first healthy replica leaves its Retry-After window, if any."""
        now = time.monotonic()
        waits = [r.cooldown_until - now for r in self.replicas if r.healthy]
        return max(0.0, min(waits)) if waits else None

    def __len__(self) -> int:
        return len(self._replicas)

