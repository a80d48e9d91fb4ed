"""Plain metric samples the decision function consumes (no Kubernetes types).

One `MetricsSample` is one scrape round at time `t`: a `ReplicaSample` for every replica that
exists (should exist) at that moment, including the ones that are not ready or whose scrape
failed; those are what keep a missing sample from ever looking like an idle replica. Its
`held_requests` are requests a gateway holds because no replica is ready: the only demand
there is to see at zero replicas (scale from zero).

A replica's `batch_pending` (Batch API requests it has accepted and not answered yet) is not
demand: a batch runs where it was created and cannot move to a new replica. It is work that
a scale-down must not destroy: such a replica is never idle, and the decision keeps at least
as many replicas as hold batches (decision.py). With `batches_shared` the replicas keep their
batches in one shared folder (`--batch-dir` on a ReadWriteMany volume), where a replica that
stops leaves its batches to the others (they take over orphaned batches): then one replica is
enough to keep them going.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ReplicaSample:
    """One replica's gauges at one scrape; `None` metrics mean the scrape failed.

    kv_cache_usage: `argosy:kv_cache_usage_perc` (fraction 0..1);
    num_waiting / num_running: `argosy:num_requests_waiting` / `argosy:num_requests_running`;
    batch_pending: `argosy:batch_requests_pending` (0 for a runtime without the gauge);
    num_finished: `argosy:request_success_total`, requests finished since the replica started;
    name: which replica (its pod's name), to find it in the next sample. With both, a request
    that came and went between two scrapes, which the gauges never show, keeps the replica
    from looking idle (decision.py); without them only the gauges say.
    """

    ready: bool = True
    kv_cache_usage: float | None = None
    num_waiting: float | None = None
    num_running: float | None = None
    batch_pending: float | None = None
    num_finished: float | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        for name in ("kv_cache_usage", "num_waiting", "num_running", "batch_pending",
                     "num_finished"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name}: must be a finite number >= 0 or None, got {value!r}")

    @property
    def is_measured(self) -> bool:
        """Ready and scraped: the only replicas whose load the decision may trust."""
        return self.ready and self.kv_cache_usage is not None and self.num_waiting is not None

    @property
    def is_idle(self) -> bool:
        """Measured with nothing running, waiting or pending in a batch (an unknown `running`
        is not idle)."""
        return (self.is_measured and self.num_waiting == 0 and self.num_running == 0
                and not self.batch_pending)

    @property
    def holds_batches(self) -> bool:
        """Measured, with Batch API requests not answered yet: removing it would lose them."""
        return self.is_measured and bool(self.batch_pending)

    @classmethod
    def from_trace(cls, obj: Mapping[str, Any]) -> ReplicaSample:
        """Parse one replica of a trace line: `{"kv": .., "waiting": .., "running": ..,
        "batch": .., "finished": .., "name": .., "ready": ..}` (optional: `batch`, Batch API
        requests pending; `finished`, requests finished so far, with `name`, the replica's)."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"replica: must be an object, got {obj!r}")
        unknown = set(obj) - {"kv", "waiting", "running", "batch", "finished", "name", "ready"}
        if unknown:
            raise ValueError(f"replica: unknown keys {sorted(unknown)}")
        ready = obj.get("ready", True)
        if not isinstance(ready, bool):
            raise ValueError(f"replica.ready: must be a boolean, got {ready!r}")
        name = obj.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"replica.name: must be a string, got {name!r}")

        def num(key: str) -> float | None:
            value = obj.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"replica.{key}: must be a number or null, got {value!r}")
            return float(value)

        return cls(ready=ready, kv_cache_usage=num("kv"), num_waiting=num("waiting"),
                   num_running=num("running"), batch_pending=num("batch"),
                   num_finished=num("finished"), name=name)


@dataclasses.dataclass(frozen=True)
class MetricsSample:
    """All replicas of one deployment at time `t` (seconds on the decision's clock), the
    requests held at a gateway for want of a ready replica, and whether the replicas share one
    batch folder (so any of them carries on another's batches)."""

    t: float
    replicas: tuple[ReplicaSample, ...]
    held_requests: int = 0
    batches_shared: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.held_requests, bool) or not isinstance(self.held_requests, int) \
                or self.held_requests < 0:
            raise ValueError(f"held_requests: must be an integer >= 0, got {self.held_requests!r}")

    @property
    def num_measured(self) -> int:
        return sum(1 for r in self.replicas if r.is_measured)

    @property
    def num_unmeasured(self) -> int:
        return len(self.replicas) - self.num_measured

    @property
    def num_holding_batches(self) -> int:
        return sum(1 for r in self.replicas if r.holds_batches)

    @property
    def batch_floor(self) -> int:
        """The fewest replicas a scale-down may leave without losing a batch: each one holding
        batches, or, with a shared folder, one while any batch is unfinished."""
        holding = self.num_holding_batches
        return min(holding, 1) if self.batches_shared else holding

    @property
    def is_idle(self) -> bool:
        """Every replica measured and idle, nothing held at a gateway (an empty sample is not
        evidence of idleness)."""
        return (bool(self.replicas) and self.held_requests == 0
                and all(r.is_idle for r in self.replicas))

    def is_idle_since(self, previous: MetricsSample | None) -> bool:
        """Idle now, and idle since `previous` as far as the request counters tell: a named
        replica whose `num_finished` is not the same known count as in `previous` (it
        finished requests, it restarted, or it was not there) served in between. Replicas
        without a name or a count, and a first sample, are judged by the gauges alone."""
        if not self.is_idle:
            return False
        if previous is None:
            return True
        before = {r.name: r.num_finished for r in previous.replicas if r.name is not None}
        return all(before.get(r.name) == r.num_finished for r in self.replicas
                   if r.name is not None and r.num_finished is not None)

    @classmethod
    def from_trace(cls, obj: Mapping[str, Any]) -> MetricsSample:
        """Parse one trace line: `{"t": seconds, "replicas": [...], "held": n,
        "batches_shared": bool}` (`held` optional: requests a gateway held at that time;
        `batches_shared` optional, default false)."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"trace line: must be an object, got {obj!r}")
        unknown = set(obj) - {"t", "replicas", "held", "batches_shared"}
        if unknown:
            raise ValueError(f"trace line: unknown keys {sorted(unknown)}")
        t = obj.get("t")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ValueError(f"t: must be a number of seconds, got {t!r}")
        replicas = obj.get("replicas")
        if not isinstance(replicas, list):
            raise ValueError(f"replicas: must be a list, got {replicas!r}")
        held = obj.get("held", 0)
        if isinstance(held, bool) or not isinstance(held, int) or held < 0:
            raise ValueError(f"held: must be an integer >= 0, got {held!r}")
        shared = obj.get("batches_shared", False)
        if not isinstance(shared, bool):
            raise ValueError(f"batches_shared: must be a boolean, got {shared!r}")
        return cls(t=float(t), replicas=tuple(ReplicaSample.from_trace(r) for r in replicas),
                   held_requests=held, batches_shared=shared)
