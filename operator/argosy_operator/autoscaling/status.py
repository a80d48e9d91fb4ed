"""Pure builders of the autoscaler's part of `LLMDeployment.status`.

The autoscaler owns `desiredReplicas`, `lastScaleTime`, `kvCacheUtilization`, `kvCachePercent`,
`queueDepth`, `autoscaling` and the `ScalingActive` / `ScalingLimited` conditions. Conditions
are one list shared with the reconciler (Ready, Progressing, Degraded) and a merge patch
replaces lists whole, so `merge_conditions` rewrites the list keeping every other type as is.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from argosy_operator.autoscaling.decision import Decision

SCALING_ACTIVE = "ScalingActive"
SCALING_LIMITED = "ScalingLimited"

# decision.limit_reason -> ScalingLimited reason (the HorizontalPodAutoscaler's words)
_LIMIT_REASONS = {
    "MaxReplicas": "TooManyReplicas",
    "MinReplicas": "TooFewReplicas",
    "ScaleUpRate": "ScaleUpLimit",
    "ScaleDownRate": "ScaleDownLimit",
}


def rfc3339(ts: float) -> str:
    """Seconds since the epoch as RFC3339 UTC with a Z, second precision (as Kubernetes writes)."""
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason,
            "message": message}


def merge_conditions(existing: Sequence[Mapping[str, Any]] | None,
                     updates: Sequence[Mapping[str, Any]], now: str) -> list[dict[str, Any]]:
    """`existing` with each update's type replaced (appended when new), others untouched.

    lastTransitionTime moves only when a condition's status changes.
    """
    out = [dict(c) for c in existing or []]
    for update in updates:
        new = dict(update)
        for i, old in enumerate(out):
            if old.get("type") == new["type"]:
                same = old.get("status") == new["status"] and old.get("lastTransitionTime")
                new["lastTransitionTime"] = old["lastTransitionTime"] if same else now
                out[i] = new
                break
        else:
            new["lastTransitionTime"] = now
            out.append(new)
    return out


def scaling_conditions(decision: Decision) -> list[dict[str, str]]:
    """ScalingActive (could it compute a decision?) and ScalingLimited (did a bound bite?)."""
    if decision.reason == "NoMetrics":
        active = condition(SCALING_ACTIVE, False, "FailedGetMetrics", decision.message)
    else:
        active = condition(SCALING_ACTIVE, True, "ValidMetrics",
                           f"{decision.reason}: {decision.message}")
    limit = decision.limit_reason
    if limit is None and decision.reason in ("AtMaxReplicas", "AtMinReplicas"):
        limit = "MaxReplicas" if decision.reason == "AtMaxReplicas" else "MinReplicas"
    if limit is not None:
        limited = condition(SCALING_LIMITED, True, _LIMIT_REASONS[limit],
                            f"desired replicas limited by {limit} to {decision.desired_replicas}")
    else:
        limited = condition(SCALING_LIMITED, False, "DesiredWithinRange",
                            "the desired replica count is within the acceptable range")
    return [active, limited]


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def build_status(decision: Decision, previous: Mapping[str, Any] | None, now: float,
                 last_scale_time: float | None) -> dict[str, Any]:
    """The status fields to merge-patch. `now`/`last_scale_time`: wall-clock epoch seconds."""
    m = decision.metrics
    previous = previous or {}
    out: dict[str, Any] = {
        "desiredReplicas": decision.desired_replicas,
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
            "limitedBy": decision.limit_reason,
            "time": rfc3339(now),
        },
        "conditions": merge_conditions(previous.get("conditions"), scaling_conditions(decision),
                                       rfc3339(now)),
    }
    if m.kv_cache_utilization is not None:
        out["kvCacheUtilization"] = _round(m.kv_cache_utilization)
        out["kvCachePercent"] = int(round(100 * m.kv_cache_utilization))
    if m.queue_depth is not None:
        out["queueDepth"] = _round(m.queue_depth)
    if last_scale_time is not None:
        out["lastScaleTime"] = rfc3339(last_scale_time)
    # Nulls inside `autoscaling` stay: in a merge patch they delete what no longer applies.
    return out
