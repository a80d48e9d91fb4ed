"""Which pods a scale-down removes: the `controller.kubernetes.io/pod-deletion-cost` annotation.

Lowering a Deployment's replicas lets its ReplicaSet controller pick the pods to delete: pods
that are unscheduled, pending or not ready go first, then, among the rest, those with the
lowest deletion cost. A Batch API job lives on the replica that created it (its files are on
that pod's volume), so deleting that pod loses the job. Right before it lowers the replicas,
the autoscaler annotates each ready pod with a cost from its newest sample:

- holding batch requests: BATCH_COST + the number pending, so it goes last (and of two such
  pods, the one with less left goes first); without a shared batch folder the decision
  never scales below the number of such pods (decision.py), so with this ranking none of
  them is chosen (with one, those chosen hand their batches to the pods that stay);
- ready but not measured (the scrape failed): BATCH_COST, since a missing sample is never
  evidence of idleness;
- measured without batches: its running + waiting requests, so the least busy pod drains.

Only on scale-down, and only pods whose value changes: Kubernetes advises against updating the
annotation on every metric change (each update is a pod write the API server fans out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from argosy_operator.autoscaling.samples import ReplicaSample
from argosy_operator.kube import PODS, ApiError, KubeClient

POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
BATCH_COST = 1_000_000
MAX_COST = 2**31 - 1  # the annotation is an int32


def deletion_cost(sample: ReplicaSample) -> int | None:
    """The cost for a pod with this sample; None for an unready pod (deleted first anyway)."""
    if not sample.ready:
        return None
    if not sample.is_measured:
        return BATCH_COST
    if sample.holds_batches:
        return min(MAX_COST, BATCH_COST + round(sample.batch_pending or 0))
    return min(BATCH_COST - 1, round((sample.num_running or 0) + (sample.num_waiting or 0)))


async def annotate_deletion_costs(client: KubeClient, namespace: str,
                                  pods: Sequence[Mapping[str, Any]],
                                  samples: Sequence[ReplicaSample]) -> int:
    """Merge-patch the annotation on each pod (paired with its sample) whose value changes.

    Returns the number of pods patched. A pod that vanished meanwhile (404) is skipped.
    """
    patched = 0
    for pod, sample in zip(pods, samples, strict=False):
        cost = deletion_cost(sample)
        metadata = pod.get("metadata") or {}
        if cost is None or (metadata.get("annotations") or {}).get(POD_DELETION_COST) == str(cost):
            continue
        try:
            await client.patch(PODS, namespace, metadata["name"],
                               {"metadata": {"annotations": {POD_DELETION_COST: str(cost)}}})
        except ApiError as exc:
            if exc.status != 404:
                raise
            continue
        patched += 1
    return patched
