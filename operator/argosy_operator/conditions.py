"""Status conditions (the `metav1.Condition` shape), merged without churn.

Several writers share `status.conditions`: the reconciler (Ready, Progressing, Degraded) and the
autoscaler (ScalingActive, ScalingLimited). A JSON merge patch replaces the whole list, so each
writer merges its own types into the list it read (`merge_conditions`) and patches with the
object's resourceVersion as a precondition (`status.patch_status` retries on conflict).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str,
              observed_generation: int | None = None) -> dict[str, Any]:
    """A condition without lastTransitionTime (merge_conditions stamps it)."""
    out: dict[str, Any] = {"type": type_, "status": "True" if status else "False",
                           "reason": reason, "message": message}
    if observed_generation is not None:
        out["observedGeneration"] = int(observed_generation)
    return out


def find_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str
                   ) -> Mapping[str, Any] | None:
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None


def merge_conditions(existing: Iterable[Mapping[str, Any]] | None,
                     updates: Iterable[Mapping[str, Any]], now: str) -> list[dict[str, Any]]:
    """`existing` with each update replacing the condition of its type.

    lastTransitionTime moves only when the status flips; a condition whose status, reason,
    message and observedGeneration are unchanged is kept as it was (so the result equals
    `existing` when nothing changed). Other writers' condition types are kept in place.
    """
    by_type = {u["type"]: dict(u) for u in updates}
    out: list[dict[str, Any]] = []
    for cond in existing or []:
        update = by_type.pop(cond.get("type", ""), None)
        if update is None:
            out.append(dict(cond))
            continue
        same_status = cond.get("status") == update["status"]
        update["lastTransitionTime"] = (cond.get("lastTransitionTime") or now) if same_status \
            else now
        keys = ("status", "reason", "message", "observedGeneration", "lastTransitionTime")
        if all(cond.get(k) == update.get(k) for k in keys):
            out.append(dict(cond))
        else:
            out.append(update)
    for update in by_type.values():
        update["lastTransitionTime"] = now
        out.append(update)
    return out
