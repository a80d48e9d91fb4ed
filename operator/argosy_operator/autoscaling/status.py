"""Pure builders of the autoscaler's part of `LLMDeployment.status`.

The autoscaler owns `desiredReplicas`, `lastScaleTime`, `kvCacheUtilization`, `kvCachePercent`,
`queueDepth`, `autoscaling` and the `ScalingActive` / `ScalingLimited` conditions. Conditions
are one list shared with the reconciler (Ready, Progressing, Degraded); the timer merges its
two types into the list it read with `argosy_operator.conditions.merge_conditions` (through
`argosy_operator.status.status_patch`), so the others' conditions are never clobbered.
"""

from __future__ import annotations

import datetime
from typing import Any

from argosy_operator.autoscaling.decision import Decision
from argosy_operator.conditions import condition

SCALING_ACTIVE = "ScalingActive"
SCALING_LIMITED = "ScalingLimited"

# decision.limit_reason -> ScalingLimited reason (the HorizontalPodAutoscaler's words)
_LIMIT_REASONS = {
    "MaxReplicas": "TooManyReplicas",
    "MinReplicas": "TooFewReplicas",
    "ScaleUpRate": "ScaleUpLimit",
    "ScaleDownRate": "ScaleDownLimit",
    "BatchRequests": "BatchRequestsPending",
}


def rfc3339(ts: float) -> str:
    """Seconds since the epoch as RFC3339 UTC with a Z, second precision (as Kubernetes writes)."""
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def scaling_conditions(decision: Decision, generation: int | None = None
                       ) -> list[dict[str, Any]]:
    """ScalingActive (could it compute a decision?) and ScalingLimited (did a bound bite?).

    generation: the LLMDeployment's metadata.generation whose policy decided (the conditions'
    observedGeneration, as the reconciler's conditions carry theirs)."""
    if decision.reason == "NoMetrics":
        active = condition(SCALING_ACTIVE, False, "FailedGetMetrics", decision.message,
                           generation)
    else:
        active = condition(SCALING_ACTIVE, True, "ValidMetrics",
                           "the autoscaler computes replicas from KV-cache utilization and "
                           "queue depth", generation)
    limit = decision.limit_reason
    if limit is None and decision.reason in ("AtMaxReplicas", "AtMinReplicas"):
        limit = "MaxReplicas" if decision.reason == "AtMaxReplicas" else "MinReplicas"
    if limit is not None:
        limited = condition(SCALING_LIMITED, True, _LIMIT_REASONS[limit],
                            f"the desired replica count is limited by {limit}", generation)
    else:
        limited = condition(SCALING_LIMITED, False, "DesiredWithinRange",
                            "the desired replica count is within the acceptable range",
                            generation)
    return [active, limited]


def inactive_conditions(reason: str, message: str, generation: int | None = None
                        ) -> list[dict[str, Any]]:
    """When no decision could be made at all (invalid policy, no Deployment); `generation`
    as in `scaling_conditions`."""
    return [condition(SCALING_ACTIVE, False, reason, message, generation),
            condition(SCALING_LIMITED, False, "ScalingInactive",
                      "the autoscaler could not compute a decision", generation)]


def disabled_status(generation: int | None = None) -> dict[str, Any]:
    """What clears the autoscaler's part of the status once spec.autoscaling.enabled is false
    (the timer no longer runs to refresh it); nulls delete in a merge patch. lastScaleTime
    stays: it is history, not a reading. `generation`: the one that switched it off."""
    return {"desiredReplicas": None, "kvCacheUtilization": None, "kvCachePercent": None,
            "queueDepth": None, "autoscaling": None,
            "conditions": inactive_conditions("AutoscalingDisabled",
                                              "spec.autoscaling.enabled is false", generation)}


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def autoscaling_status(decision: Decision, last_scale_time: float | None,
                       generation: int | None = None) -> dict[str, Any]:
    """The status fields the autoscaler owns (conditions unmerged: a list of updates).

    No timestamps other than lastScaleTime, so an unchanged decision produces an unchanged
    status and `status_patch` writes nothing. `last_scale_time`: wall-clock epoch seconds;
    `generation`: as in `scaling_conditions`.
    """
    m = decision.metrics
    out: dict[str, Any] = {
        "desiredReplicas": decision.desired_replicas,
        # Nulls stay: in a merge patch they delete what no longer applies.
        "autoscaling": {
            "reason": decision.reason,
            "message": decision.message,
            "panic": decision.panic,
            "currentReplicas": decision.current_replicas,
            "desiredReplicas": decision.desired_replicas,
            "readyReplicas": m.ready_replicas,
            "measuredReplicas": m.measured_replicas,
            "kvCacheUtilization": _round(m.kv_cache_utilization),
            "queueDepth": _round(m.queue_depth),
            "runningPerReplica": _round(m.running),
            "demandReplicas": _round(m.demand),
            "stableRatio": _round(m.stable_ratio),
            "panicRatio": _round(m.panic_ratio),
            "recommendation": m.recommendation,
            "batchRequestsPending": _round(m.batch_pending),
            "batchReplicas": m.batch_replicas,
            "limitedBy": decision.limit_reason,
        },
        "conditions": scaling_conditions(decision, generation),
    }
    # Readings of this decision; null (deleted) without one (no replica could be scraped, or
    # none runs), so `kubectl get llmd` never shows an old reading as the current one.
    kv = m.kv_cache_utilization
    out["kvCacheUtilization"] = _round(kv)
    out["kvCachePercent"] = None if kv is None else int(round(100 * kv))
    out["queueDepth"] = _round(m.queue_depth)
    if last_scale_time is not None:
        out["lastScaleTime"] = rfc3339(last_scale_time)
    return out
