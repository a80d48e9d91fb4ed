"""Drift: whether a child the operator applied was edited by someone else since.

The watch of a child delivers every change of it: the operator's own writes, status updates
(a Deployment's arrive all through a rollout), and edits by hand (`kubectl edit`, `kubectl
label`). Only the last kind calls for a reapply, and telling them apart must cost no API
request, so the check reads nothing but the object in the event:

- Every child carries the manifest the operator applied to it (`argosy.dev/last-applied`,
  the base of the three-way merge patch in `reconcile`). A live object that no longer holds
  that record (the same leniency as the patch: keys the API server or other controllers added
  are fine) was edited on a field the operator manages; the operator's own writes and status
  updates leave it holding the record. `metadata.generation` would not do: the operator's
  own patches bump it too, a label edit does not, and only some kinds have one. A hash of
  the applied manifest would say no more than the record, and lose its leniency.
- The record leaves `spec.replicas` out (the autoscaler may own it). Where the operator keeps
  the Deployment's replicas (autoscaling off), `remember` notes the count it applied, and a
  different count is drift; where the autoscaler owns them, nothing is noted and its scaling
  is never drift.
- An API server may store a value in another spelling than the one applied (a quantity
  "0.5" is stored as "500m"); such a child never holds its record, and each status update
  would reapply it (each reapply a no-op patch: no loop, but API requests per status event).
  So `remember` also notes a digest of the operator-managed fields as the API server returned
  them after the operator's write: a live object that does not hold its record but still has
  that digest is as the operator left it.

What `remember` notes lives in this process (by uid); the resume reconcile at startup applies
every child and notes them all again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from argosy_operator.constants import ANNOTATION_LAST_APPLIED
from argosy_operator.merge_patch import holds


@dataclass(frozen=True)
class _Applied:
    digest: str  # of the managed fields, as the API server returned them
    replicas: int | None  # spec.replicas the operator keeps; None: not its to keep


_applied: dict[str, _Applied] = {}


def last_applied(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record of the operator's last apply on `obj`, or None (missing or unreadable)."""
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_LAST_APPLIED)
    try:
        record = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _project(live: Any, record: Any) -> Any:
    """`live` cut down to the paths of `record` (lists and scalars whole)."""
    if isinstance(record, Mapping) and isinstance(live, Mapping):
        return {k: _project(live[k], v) for k, v in record.items() if k in live}
    return live


def _digest(obj: Mapping[str, Any], record: Mapping[str, Any]) -> str:
    view = json.dumps(_project(obj, record), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(view.encode()).hexdigest()


def _replicas(obj: Mapping[str, Any]) -> int:
    return int((obj.get("spec") or {}).get("replicas", 1))  # 1: the API server's default


def _first_difference(live: Any, record: Any, path: str) -> str:
    """The path of the first field of `record` that `live` does not hold (for the log)."""
    if isinstance(record, Mapping) and isinstance(live, Mapping):
        for key, want in record.items():
            if key not in live or not holds(live[key], want):
                return _first_difference(live.get(key), want, f"{path}.{key}" if path else key)
    return path


def remember(obj: Mapping[str, Any], *, replicas: int | None = None) -> None:
    """Note `obj` as the operator left it (the API server's answer to its create or patch,
    or the live object when no write was needed). `replicas`: the spec.replicas the operator
    keeps on it (a Deployment with autoscaling off), else None."""
    uid = (obj.get("metadata") or {}).get("uid")
    record = last_applied(obj)
    if uid and record is not None:
        _applied[uid] = _Applied(_digest(obj, record), replicas)


def forget(obj: Mapping[str, Any]) -> None:
    """Drop what `remember` noted of a child that is gone."""
    _applied.pop((obj.get("metadata") or {}).get("uid") or "", None)


def drifted(obj: Mapping[str, Any]) -> str | None:
    """The first operator-managed field of the child `obj` that differs from what the
    operator applied (e.g. "spec.template.spec.containers"), or None when there is none."""
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None  # on its way out; its deletion event decides
    record = last_applied(obj)
    if record is None:
        return f"metadata.annotations.{ANNOTATION_LAST_APPLIED}"
    applied = _applied.get(meta.get("uid") or "")
    if applied is not None and applied.replicas is not None \
            and _replicas(obj) != applied.replicas:
        return "spec.replicas"
    if holds(obj, record):
        return None
    if applied is not None and applied.digest == _digest(obj, record):
        return None  # stored in the API server's own spelling, unchanged since the write
    return _first_difference(obj, record, "")
