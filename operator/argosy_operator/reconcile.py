"""Bring an LLMDeployment's children in line with its spec: create, patch, or delete them.

Idempotent and quiet: children have deterministic names, an existing child (a restart in the
middle of a reconcile, a create that raced) is patched rather than duplicated, and a child that
already holds the desired fields gets no API write at all.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from argosy_operator import drift
from argosy_operator.builders import (
    build_deployment,
    build_lora_configmap,
    build_pdb,
    build_service,
    build_servicemonitor,
)
from argosy_operator.builders.common import check_name
from argosy_operator.constants import (
    ANNOTATION_LAST_APPLIED,
    LABEL_MANAGED_BY,
    OPERATOR_NAME,
)
from argosy_operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    PDBS,
    SERVICEMONITORS,
    SERVICES,
    ApiError,
    KubeClient,
    Resource,
)
from argosy_operator.merge_patch import three_way_merge_patch
from argosy_operator.spec import autoscaling_enabled, normalize_spec


class ChildConflictError(Exception):
    """A child's name is taken by an object the operator does not manage (or it is being
    deleted); retrying later may help, overwriting it would not be ours to do.

    `being_deleted`: the object is on its way out (its finalizers or the garbage collector
    hold it), which clears by itself, usually within seconds; someone else's object stays
    until a person acts."""

    def __init__(self, message: str, *, being_deleted: bool = False) -> None:
        super().__init__(message)
        self.being_deleted = being_deleted


@dataclass
class ReconcileResult:
    """What a reconcile did, one line per write ("created Deployment a"), for Events."""

    actions: list[str] = field(default_factory=list)
    deployment: dict[str, Any] | None = None


def last_applied_record(desired: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest remembered in the annotation: without the annotation itself, and without
    spec.replicas, which is compared with the live object directly (the autoscaler may own
    it, and a record of it would make the operator null it out when autoscaling turns on)."""
    record = copy.deepcopy(dict(desired))
    record.get("spec", {}).pop("replicas", None)
    annotations = record.get("metadata", {}).get("annotations", {})
    annotations.pop(ANNOTATION_LAST_APPLIED, None)
    if "annotations" in record.get("metadata", {}) and not annotations:
        del record["metadata"]["annotations"]
    return record


def with_last_applied(desired: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(desired))
    record = json.dumps(last_applied_record(desired), sort_keys=True, separators=(",", ":"))
    out["metadata"].setdefault("annotations", {})[ANNOTATION_LAST_APPLIED] = record
    return out


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid in `obj`'s controller owner reference, or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def _is_ours(live: Mapping[str, Any], owner_uid: str | None) -> bool:
    """Whether `live` is the operator's: its managed-by label, or (that label removed by hand,
    `kubectl label ... app.kubernetes.io/managed-by-`) a controller reference to the owner
    being reconciled. The reference alone is enough: only the operator sets it, and an
    object someone else made under the child's name has none to this owner's uid."""
    if ((live.get("metadata") or {}).get("labels") or {}).get(LABEL_MANAGED_BY) == OPERATOR_NAME:
        return True
    return owner_uid is not None and _controller_uid(live) == owner_uid


def _check_ours(res: Resource, live: Mapping[str, Any], owner_uid: str | None) -> None:
    meta = live.get("metadata") or {}
    kind = live.get("kind", res.plural)
    if meta.get("deletionTimestamp"):
        raise ChildConflictError(f"{kind} {meta.get('name')} is being deleted; retrying",
                                 being_deleted=True)
    if not _is_ours(live, owner_uid):
        raise ChildConflictError(
            f"{kind} {meta.get('name')} exists and is not managed by {OPERATOR_NAME}; "
            "rename the LLMDeployment or delete that object")


_UNREAD: Any = object()  # apply_child's `live` when the caller has not read the child


async def apply_child(client: KubeClient, res: Resource, desired: Mapping[str, Any], *,
                      keeps_replicas: bool = False, live: dict[str, Any] | None = _UNREAD
                      ) -> tuple[str | None, dict[str, Any]]:
    """Create or three-way-patch one child. Returns ("created" | "updated" | None, object).

    The object is noted for drift detection (`drift.remember`); `keeps_replicas`: the operator
    keeps the desired spec.replicas (autoscaling off), so another count is drift. `live`: the
    child as just read (None: absent), else it is read here. An API error names the child
    (the owner's Degraded condition quotes it).
    """
    ns = desired["metadata"]["namespace"]
    name = desired["metadata"]["name"]
    body = with_last_applied(desired)
    replicas = (desired.get("spec") or {}).get("replicas") if keeps_replicas else None

    def applied(action: str | None, obj: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        drift.remember(obj, replicas=replicas)
        return action, dict(obj)

    try:
        if live is _UNREAD:
            live = await client.get(res, ns, name)
        if live is None:
            try:
                return applied("created", await client.create(res, ns, body))
            except ApiError as exc:
                if exc.status != 409:
                    raise
                live = await client.get(res, ns, name)  # created meanwhile: patch it instead
                if live is None:
                    raise
        # The three-way patch below puts back any of the operator's labels removed by hand.
        _check_ours(res, live, _controller_uid(desired))
        patch = three_way_merge_patch(drift.last_applied(live), body, live)
        if not patch:
            return applied(None, live)
        return applied("updated", await client.patch(res, ns, name, patch))
    except ApiError as exc:
        # "403 Forbidden: services is forbidden: ..." alone does not say which child failed.
        raise ApiError(exc.status, exc.reason,
                       f"{desired.get('kind', res.plural)} {ns}/{name}: {exc.message}") from exc


async def delete_child(client: KubeClient, res: Resource, namespace: str, name: str, *,
                       owner_uid: str | None = None) -> bool:
    """Delete a child the spec no longer asks for, only if it exists and is ours (its label,
    or a controller reference to `owner_uid`).

    An object of that name that the operator does not manage is left alone without a
    conflict: the spec does not want the child, so nothing clashes (a user's own ConfigMap
    named like the LLMDeployment is common).
    """
    live = await client.get(res, namespace, name)
    if (live is None or (live.get("metadata") or {}).get("deletionTimestamp")
            or not _is_ours(live, owner_uid)):
        return False
    return await client.delete(res, namespace, name)


async def _read_children(client: KubeClient, llmd: Mapping[str, Any],
                         resources: list[Resource]) -> dict[Resource, dict[str, Any] | None]:
    """Read every child the spec wants (each named like the LLMDeployment) and check that
    each is absent or ours, before any write: a foreign object in one child's place
    (ChildConflictError) must not leave the others applied (a Deployment whose pods no
    Service reaches, say)."""
    meta = llmd["metadata"]
    lives: dict[Resource, dict[str, Any] | None] = {}
    for res in resources:
        live = lives[res] = await client.get(res, meta["namespace"], meta["name"])
        if live is not None:
            _check_ours(res, live, meta.get("uid"))
    return lives


async def reconcile(client: KubeClient, llmd: Mapping[str, Any]) -> ReconcileResult:
    """Apply the Deployment, Service, LoRA ConfigMap, PodDisruptionBudget and ServiceMonitor
    of `llmd`.

    Raises InvalidSpecError for a spec that cannot be built (the CRD normally rejects
    those), before any child is read or written; ChildConflictError (before any write); or
    ApiError.
    """
    meta = llmd["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta.get("uid")
    check_name(name)
    spec = normalize_spec(llmd.get("spec") or {})
    result = ReconcileResult()

    def note(action: str | None, kind: str) -> None:
        if action:
            result.actions.append(f"{action} {kind} {name}")

    # Every child is built before anything is read or written: a builder that refuses the
    # spec (the Deployment's, on a model.source it cannot parse) must not follow a write of
    # another child (the LoRA ConfigMap, applied first). spec.replicas is set further down,
    # once it is known whether the Deployment exists.
    deployment = build_deployment(llmd, spec, None)
    lora = build_lora_configmap(llmd, spec)
    service = build_service(llmd, spec)
    pdb = build_pdb(llmd, spec)
    has_monitors = await client.has_resource(SERVICEMONITORS)
    monitor = build_servicemonitor(llmd, spec) if has_monitors else None
    lives = await _read_children(client, llmd, [
        res for res, child in ((CONFIGMAPS, lora), (DEPLOYMENTS, True), (SERVICES, service),
                               (PDBS, pdb), (SERVICEMONITORS, monitor)) if child is not None])

    if lora is not None:
        # Before the Deployment: its pods mount this ConfigMap and would not start without it.
        action, _ = await apply_child(client, CONFIGMAPS, lora, live=lives[CONFIGMAPS])
        note(action, "ConfigMap")

    if not autoscaling_enabled(spec):
        deployment["spec"]["replicas"] = int(spec["replicas"])
    elif lives[DEPLOYMENTS] is None:
        # The autoscaler owns spec.replicas: set it only when creating the Deployment.
        deployment["spec"]["replicas"] = int(spec["autoscaling"]["minReplicas"])
    action, result.deployment = await apply_child(
        client, DEPLOYMENTS, deployment,
        keeps_replicas=not autoscaling_enabled(spec), live=lives[DEPLOYMENTS])
    note(action, "Deployment")
    if lora is None and await delete_child(client, CONFIGMAPS, ns, name, owner_uid=uid):
        # After the Deployment, whose patch above took the mount off the pod template.
        note("deleted", "ConfigMap")
    action, _ = await apply_child(client, SERVICES, service, live=lives[SERVICES])
    note(action, "Service")

    if pdb is not None:
        action, _ = await apply_child(client, PDBS, pdb, live=lives[PDBS])
        note(action, "PodDisruptionBudget")
    elif await delete_child(client, PDBS, ns, name, owner_uid=uid):
        note("deleted", "PodDisruptionBudget")

    if has_monitors:
        if monitor is not None:
            action, _ = await apply_child(client, SERVICEMONITORS, monitor,
                                          live=lives[SERVICEMONITORS])
            note(action, "ServiceMonitor")
        elif await delete_child(client, SERVICEMONITORS, ns, name, owner_uid=uid):
            note("deleted", "ServiceMonitor")
    return result
