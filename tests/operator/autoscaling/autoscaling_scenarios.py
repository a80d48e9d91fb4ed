"""Shared load scenarios: a closed loop where the replica count follows the decision.

Demand is a total over the fleet (requests waiting in aggregate, KV usage summed), spread evenly
over the ready replicas, the way a gateway spreads load; so scaling up really lowers the
per-replica numbers the autoscaler sees next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from argosy_operator.autoscaling.autoscaler import Autoscaler
from argosy_operator.autoscaling.decision import Decision
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample, ReplicaSample

# t -> (total waiting requests across the fleet, total KV usage in replica-fractions)
Demand = Callable[[float], tuple[float, float]]


@dataclasses.dataclass
class Tick:
    t: float
    current: int
    decision: Decision

    @property
    def desired(self) -> int:
        return self.decision.desired_replicas


def fleet_sample(t: float, replicas: int, waiting: float, kv: float,
                 broken: Callable[[float, int], str | None] | None = None,
                 batches: Callable[[float, int], float] | None = None) -> MetricsSample:
    """`broken(t, i)` may return "unready" or "failed" for replica i (then it carries no load);
    `batches(t, i)`: Batch API requests pending on replica i (default none)."""
    states = [broken(t, i) if broken else None for i in range(replicas)]
    healthy = max(1, sum(1 for s in states if s is None))
    out = []
    for i, s in enumerate(states):
        if s == "unready":
            out.append(ReplicaSample(ready=False))
        elif s == "failed":
            out.append(ReplicaSample(ready=True))
        else:
            w = waiting / healthy
            out.append(ReplicaSample(ready=True, kv_cache_usage=min(1.0, kv / healthy),
                                     num_waiting=w, num_running=2.0 if (w or kv) else 0.0,
                                     batch_pending=batches(t, i) if batches else 0.0))
    return MetricsSample(t=t, replicas=tuple(out))


def run_closed_loop(policy: AutoscalingPolicy, demand: Demand, start_replicas: int,
                    duration: float, dt: float = 5.0,
                    broken: Callable[[float, int], str | None] | None = None,
                    batches: Callable[[float, int], float] | None = None) -> list[Tick]:
    autoscaler = Autoscaler(policy)
    current = start_replicas
    ticks: list[Tick] = []
    t = 0.0
    while t <= duration:
        waiting, kv = demand(t)
        autoscaler.observe(fleet_sample(t, current, waiting, kv, broken, batches))
        decision = autoscaler.decide(current, now=t)
        ticks.append(Tick(t, current, decision))
        current = decision.desired_replicas
        t += dt
    return ticks


def first_change(ticks: list[Tick], after: float = -1.0) -> Tick | None:
    return next((k for k in ticks if k.t > after and k.desired != k.current), None)
