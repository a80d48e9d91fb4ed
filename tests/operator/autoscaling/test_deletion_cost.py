"""The pod-deletion-cost ranking: pods holding batch requests go last, idle ones first."""

from __future__ import annotations

from argosy_operator.autoscaling.deletion_cost import BATCH_COST, MAX_COST, deletion_cost
from argosy_operator.autoscaling.samples import ReplicaSample


def measured(running: float = 0, waiting: float = 0, batch: float = 0) -> ReplicaSample:
    return ReplicaSample(kv_cache_usage=0.1, num_waiting=waiting, num_running=running,
                         batch_pending=batch)


def test_costs_rank_idle_then_busy_then_unknown_then_batch_holders() -> None:
    ranked = [measured(), measured(running=3), measured(running=3, waiting=4),
              ReplicaSample(ready=True),  # scrape failed: maybe holding a batch
              measured(batch=1), measured(running=9, batch=500)]
    costs = [deletion_cost(s) for s in ranked]
    assert costs == [0, 3, 7, BATCH_COST, BATCH_COST + 1, BATCH_COST + 500]


def test_unready_pods_are_left_alone_and_costs_stay_int32() -> None:
    assert deletion_cost(ReplicaSample(ready=False)) is None
    assert deletion_cost(measured(batch=1e12)) == MAX_COST
    # However busy, a pod without batches ranks below one holding a single batch request.
    assert deletion_cost(measured(running=1e9, waiting=1e9)) == BATCH_COST - 1
