"""The LLMDeployment's status: replica counts, selector, endpoint and conditions.

`compute_status` is pure (children in, status out); `status_patch` turns it into the smallest
patch against the current status (None when nothing changed, so an idle operator writes
nothing); `refresh_status` reads the children and writes the patch.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from argosy_operator.autoscaling.status import SCALING_ACTIVE, disabled_status
from argosy_operator.builders.common import endpoint_url, selector_string
from argosy_operator.conditions import condition, find_condition, merge_conditions, now_rfc3339
from argosy_operator.constants import COND_DEGRADED, COND_PROGRESSING, COND_READY, COND_STALLED
from argosy_operator.kube import LLMDEPLOYMENTS, ApiError, KubeClient
from argosy_operator.pod_problems import pod_problems
from argosy_operator.spec import autoscaling_enabled, with_defaults
from argosy_operator.workload import get_deployment, list_pods

CONFLICT_RETRIES = 3
# Degraded reasons set by the reconciler itself (see handlers), not derived from the children.
RECONCILE_FAILURES = frozenset({"InvalidSpec", "ChildConflict", "ApplyFailed"})


def _ready_condition(desired: int, ready: int, problems: Sequence[Any], gen: int | None
                     ) -> dict[str, Any]:
    counts = f"{ready}/{desired} replicas ready"
    if desired == 0:
        return condition(COND_READY, False, "ScaledToZero", "scaled to zero replicas", gen)
    if ready == 0:
        if problems:
            return condition(COND_READY, False, problems[0].reason,
                             f"{counts}: {problems[0].message}", gen)
        return condition(COND_READY, False, "NoReplicasReady", counts, gen)
    if ready < desired:
        return condition(COND_READY, True, "PartiallyReady", counts, gen)
    return condition(COND_READY, True, "AllReplicasReady", counts, gen)


def compute_status(llmd: Mapping[str, Any], deployment: Mapping[str, Any] | None,
                   pods: Sequence[Mapping[str, Any]], observed_generation: int | None
                   ) -> dict[str, Any]:
    """The status the reconciler owns, from the Deployment and pods it sees."""
    # Unchecked: a spec the reconcile refused (InvalidSpec) still gets a status from its
    # children's events; checking it here would raise on every pod event instead.
    spec = with_defaults(llmd.get("spec") or {})
    name = llmd["metadata"]["name"]
    gen = observed_generation
    base: dict[str, Any] = {
        "selector": selector_string(name),
        "endpoint": endpoint_url(llmd, spec["service"]["port"]),
        # .get: an object admitted under an older CRD may lack it (a KeyError here failed
        # every pod event of that object).
        "model": spec["model"].get("name"),
    }
    if observed_generation is not None:
        base["observedGeneration"] = int(observed_generation)
    if deployment is None:
        base.update(replicas=0, readyReplicas=0, updatedReplicas=0)
        base["conditions"] = [
            condition(COND_READY, False, "DeploymentMissing", "the Deployment does not exist", gen),
            condition(COND_PROGRESSING, True, "Creating", "creating the Deployment", gen),
            condition(COND_DEGRADED, False, "AsExpected", "no problems seen", gen),
        ]
        return base
    dep_status = deployment.get("status") or {}
    desired = int((deployment.get("spec") or {}).get("replicas", 1))
    total = int(dep_status.get("replicas", 0))
    ready = int(dep_status.get("readyReplicas", 0))
    updated = int(dep_status.get("updatedReplicas", 0))
    base.update(replicas=total, readyReplicas=ready, updatedReplicas=updated)

    problems = pod_problems(pods)
    dep_conditions = dep_status.get("conditions") or []
    dep_progressing = find_condition(dep_conditions, "Progressing") or {}
    deadline = (dep_progressing.get("status") == "False"
                and dep_progressing.get("reason") == "ProgressDeadlineExceeded")
    replica_failure = find_condition(dep_conditions, "ReplicaFailure") or {}
    synced = int(dep_status.get("observedGeneration", 0)) >= int(
        (deployment.get("metadata") or {}).get("generation", 0))

    if deadline:
        progressing = condition(COND_PROGRESSING, False, "ProgressDeadlineExceeded",
                                dep_progressing.get("message", "rollout stalled"), gen)
    elif not synced or updated < desired or total > desired or ready < desired:
        if not synced or updated < desired:
            reason = "RollingUpdate"  # pods of an older template remain
        elif total > desired:
            reason = "ScalingDown"  # surplus pods are terminating
        else:
            reason = "WaitingForReplicas"  # scaling up, or pods not ready yet
        progressing = condition(
            COND_PROGRESSING, True, reason,
            f"{updated}/{desired} replicas updated, {ready} ready, {total} total", gen)
    else:
        progressing = condition(COND_PROGRESSING, False, "RolloutComplete",
                                f"{desired} replicas updated and ready", gen)

    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        degraded = condition(COND_DEGRADED, True, problems[0].reason,
                             problems[0].message + more, gen)
    elif deadline:
        degraded = condition(COND_DEGRADED, True, "ProgressDeadlineExceeded",
                             dep_progressing.get("message", "rollout stalled"), gen)
    elif replica_failure.get("status") == "True":
        degraded = condition(COND_DEGRADED, True, "ReplicaFailure",
                             replica_failure.get("message", "pods cannot be created"), gen)
    else:
        degraded = condition(COND_DEGRADED, False, "AsExpected", "no problems seen", gen)
    base["conditions"] = [_ready_condition(desired, ready, problems, gen), progressing, degraded]
    return base


def refused_spec_conditions(message: str, gen: int | None) -> list[dict[str, Any]]:
    """The reconciler's conditions for a generation whose spec it refused (InvalidSpec): a
    failure no retry fixes (Stalled, which kstatus and the GitOps tools built on it report as
    failed), not Ready and not progressing, whatever the pods of the last applied spec, which
    keep running, do."""
    return [condition(type_, status, "InvalidSpec", message, gen) for type_, status in (
        (COND_READY, False), (COND_PROGRESSING, False), (COND_DEGRADED, True),
        (COND_STALLED, True))]


def _refusal(status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The Stalled condition while it is True (a spec was refused), else None; its
    observedGeneration is the refused generation."""
    stalled = find_condition((status or {}).get("conditions"), COND_STALLED)
    return stalled if (stalled or {}).get("status") == "True" else None


def _refusal_stands(status: Mapping[str, Any]) -> bool:
    """Whether the reconciler's last word is a refusal: Stalled=True, and no reconcile of a
    later generation has reported since (one that fails with a retried error, ChildConflict
    or ApplyFailed, writes Degraded with its own generation)."""
    refusal = _refusal(status)
    degraded = find_condition(status.get("conditions"), COND_DEGRADED) or {}
    return refusal is not None and degraded.get("reason") == "InvalidSpec" \
        and degraded.get("observedGeneration") == refusal.get("observedGeneration")


def spec_refused(llmd: Mapping[str, Any]) -> bool:
    """Whether `llmd`'s status says a spec was refused and nothing was reconciled since: its
    current spec, or a newer one whose reconcile has not reported yet (which may well be
    refused too: acting on it before then would scale from a spec never checked)."""
    return _refusal_stands(llmd.get("status") or {})


def refusal_superseded(llmd: Mapping[str, Any]) -> bool:
    """Whether `llmd`'s status says Stalled for a spec refused at an earlier generation than
    its current one (a newer spec not yet applied: in progress, not failed)."""
    refusal = _refusal(llmd.get("status"))
    return refusal is not None and refusal.get("observedGeneration") != (
        llmd.get("metadata") or {}).get("generation")


def _without_nulls(value: Any) -> Any:
    """`value` as the API server stores it after a merge patch: a null deletes its key."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def status_patch(current: Mapping[str, Any] | None, computed: Mapping[str, Any], now: str
                 ) -> dict[str, Any] | None:
    """The fields of `computed` that differ from `current` (conditions merged); None if none.

    A null in `computed` means "absent" (the patch deletes the key): compared as such, or a
    nested null (the autoscaler's `status.autoscaling.limitedBy`, say) would differ from the
    stored object forever, and every tick would write the same status again."""
    current = current or {}
    patch = {k: v for k, v in computed.items()
             if k != "conditions" and current.get(k) != _without_nulls(v)}
    if "conditions" in computed:
        merged = merge_conditions(current.get("conditions"), computed["conditions"], now)
        if merged != list(current.get("conditions") or []):
            patch["conditions"] = merged
    return patch or None


async def patch_status(client: KubeClient, llmd: Mapping[str, Any],
                       make_patch: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Patch the status subresource with `make_patch(current_status) -> patch | None`, guarded
    by the object's resourceVersion; on a conflict re-read the object and try again.
    `make_patch` may be a coroutine function (to read more state on every attempt).
    Returns (the patch written or None, the object it was computed from)."""
    meta = llmd["metadata"]
    obj: Mapping[str, Any] = llmd
    for attempt in range(CONFLICT_RETRIES + 1):
        patch = make_patch(obj.get("status") or {})
        if inspect.isawaitable(patch):
            patch = await patch
        if not patch:
            return None, dict(obj)
        body: dict[str, Any] = {"status": patch}
        rv = obj["metadata"].get("resourceVersion")
        if rv:
            body["metadata"] = {"resourceVersion": rv}
        try:
            await client.patch(LLMDEPLOYMENTS, meta["namespace"], meta["name"], body,
                               subresource="status")
            return patch, dict(obj)
        except ApiError as exc:
            if exc.status != 409 or attempt == CONFLICT_RETRIES:
                raise
        await asyncio.sleep(0.1 * (attempt + 1))
        fresh = await client.get(LLMDEPLOYMENTS, meta["namespace"], meta["name"])
        if fresh is None:
            return None, dict(obj)
        obj = fresh
    return None, dict(obj)  # pragma: no cover


async def refresh_status(client: KubeClient, llmd: Mapping[str, Any], *,
                         observed_generation: int | None = None,
                         invalid_spec: str | None = None
                         ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Read the Deployment and pods, write the status if it changed; returns the patch (None
    when nothing changed) and the object it was computed against (after conflict retries).

    `observed_generation=None` keeps the recorded one (child events do not reconcile the spec).
    `invalid_spec`: the reconcile of `observed_generation` refused its spec with this message.
    """
    meta = llmd["metadata"]

    async def make_patch(current: Mapping[str, Any]) -> dict[str, Any] | None:
        # The children are read on every attempt, after the owner was: a retry after a
        # conflict must not reuse pods listed before the write that caused the conflict (a
        # stale pod list turned Degraded back on and posted a second Warning).
        deployment = await get_deployment(client, meta["namespace"], meta["name"])
        # A refused spec's conditions do not depend on the pods (and a name refused as too
        # long for a label value would make the API server refuse the pods' label selector).
        pods = [] if invalid_spec is not None else await list_pods(
            client, meta["namespace"], meta["name"])
        gen = observed_generation
        computed = compute_status(llmd, deployment, pods,
                                  current.get("observedGeneration") if gen is None else gen)
        degraded = find_condition(current.get("conditions"), COND_DEGRADED) or {}
        stalled = find_condition(current.get("conditions"), COND_STALLED)
        refusal = _refusal(current)
        if invalid_spec is not None:
            computed["conditions"] = refused_spec_conditions(invalid_spec, gen)
        elif gen is None and _refusal_stands(current):
            # A spec is refused, the current one or one that a newer spec replaced whose
            # reconcile has not reported yet: the refusal's conditions stay until a reconcile
            # says otherwise; a child event updates the replica counts only. (Following the
            # children here made Ready flap True and Stalled False between two refused specs.)
            computed["conditions"] = []
        elif gen is None:
            if degraded.get("reason") in RECONCILE_FAILURES:
                # Only a successful reconcile clears a reconcile failure, not a pod event.
                computed["conditions"] = [c for c in computed["conditions"]
                                          if c["type"] != COND_DEGRADED]
            if refusal is not None:
                # Refused at an earlier generation: the current spec is not applied yet (or
                # failed in a way that is retried), which is in progress, not failed for good.
                computed["conditions"].append(condition(
                    COND_STALLED, False, "SpecChanged",
                    "the refused spec was replaced; the current one is not applied yet",
                    meta.get("generation")))
        elif stalled is not None:
            # This generation was applied: whatever an earlier one refused is over.
            computed["conditions"].append(condition(
                COND_STALLED, False, "AsExpected", "the spec was applied", gen))
        if not autoscaling_enabled(llmd.get("spec") or {}) \
                and find_condition(current.get("conditions"), SCALING_ACTIVE):
            # Autoscaling was switched off: its timer stopped, so clear what it wrote (the
            # printer columns showed its last KV-cache % and queue depth forever).
            cleared = disabled_status(meta.get("generation"))
            computed["conditions"] = computed["conditions"] + cleared.pop("conditions")
            computed.update(cleared)
        return status_patch(current, computed, now_rfc3339())

    return await patch_status(client, llmd, make_patch)
