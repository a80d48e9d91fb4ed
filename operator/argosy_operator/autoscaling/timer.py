"""The kopf timer that autoscales each LLMDeployment with `spec.autoscaling.enabled: true`.

Every tick (ARGOSY_AUTOSCALE_TICK_SECONDS, default 1 s; each object is scraped only every
`scrapeIntervalSeconds`, which kopf timers cannot vary per object): read the Deployment (same
name and namespace as the LLMDeployment), list its pods by the selector label, scrape the ready
ones concurrently, read a gateway's scale-from-zero request (activation.py), feed the
per-object `Autoscaler`, and when the decision changes the replica
count, merge-patch the Deployment's `spec.replicas`, guarded by the resourceVersion read (on a
scale-down, after ranking the pods by `controller.kubernetes.io/pod-deletion-cost`,
deletion_cost.py) and post an Event. The status
(desiredReplicas, lastScaleTime, metrics, ScalingActive/ScalingLimited) goes through the
reconciler's `patch_status` (resourceVersion-guarded, conditions merged), only when it changed.

With autoscaling disabled the `when` filter keeps the timer from running at all, so
`kubectl scale llmd` (the scale subresource) is the only thing that sets replicas.
State lives in kopf's per-object `memo`: an operator restart starts a fresh window, which only
delays scale-downs (a full stabilization window must be observed first).

The API client, the Deployment/pod helpers and the status writer are the operator's own
(`argosy_operator.handlers.get_client`, `workload`, `status`); the timer is registered in
kopf's default registry on import, which `argosy_operator.handlers` does at its end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf

from argosy_operator.autoscaling.activation import activation_requested
from argosy_operator.autoscaling.autoscaler import Autoscaler
from argosy_operator.autoscaling.deletion_cost import annotate_deletion_costs
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample, ReplicaSample
from argosy_operator.autoscaling.scraper import scrape_pods
from argosy_operator.autoscaling.status import autoscaling_status, inactive_conditions
from argosy_operator.conditions import now_rfc3339
from argosy_operator.constants import GROUP, PLURAL, VERSION
from argosy_operator.kube import API_ERRORS, ApiError, KubeClient
from argosy_operator.status import CONFLICT_RETRIES, patch_status, spec_refused, status_patch
from argosy_operator.workload import (
    deployment_replicas,
    get_deployment,
    list_pods,
    scale_deployment,
)

TIMER_ID = "autoscaling"
TICK_SECONDS = float(os.environ.get("ARGOSY_AUTOSCALE_TICK_SECONDS", "1.0"))
_MEMO_KEY = "argosy_autoscaling"
_INVALID_KEY = "argosy_autoscaling_invalid"  # the invalid policy last logged


@dataclasses.dataclass
class _ObjectState:
    """What the timer keeps per LLMDeployment between ticks (in kopf's memo)."""

    autoscaler: Autoscaler
    last_tick: float = float("-inf")  # monotonic
    last_scale_wall: float | None = None


def autoscaling_enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf `when` filter: run only for objects with autoscaling enabled."""
    autoscaling = spec.get("autoscaling") or {}
    return isinstance(autoscaling, Mapping) and autoscaling.get("enabled") is True


def _client() -> KubeClient:
    # Imported here: handlers imports this module at its end (to register the timer).
    from argosy_operator.handlers import get_client

    return get_client()


async def _write_status(client: KubeClient, llmd: Mapping[str, Any],
                        computed: Mapping[str, Any], logger: Any) -> None:
    try:
        await patch_status(client, llmd,
                           lambda current: status_patch(current, computed, now_rfc3339()))
    except API_ERRORS as exc:
        # Not raised: kopf retries a failed timer only after its backoff (60 s), which would
        # stop the autoscaling that long; the next tick computes and writes the status again.
        # The same for every API call of a tick, an unreachable API server included.
        logger.warning(f"autoscaling: cannot write the status: {exc}")


def _inactive(reason: str, message: str, generation: int | None) -> dict[str, Any]:
    """The status of a tick that decides nothing (invalid policy, refused spec, no
    Deployment): the conditions say why, and the readings go (nulls delete in a merge patch),
    as for NoMetrics: nothing is scraped meanwhile, so the printer columns (KV-cache %, Queue)
    showed the last reading, frozen, as the current one for as long as that lasted."""
    return {"kvCacheUtilization": None, "kvCachePercent": None, "queueDepth": None,
            "conditions": inactive_conditions(reason, message, generation)}


def _live_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Terminating pods are neither capacity nor demand any more; nor are pods that ended
    # (an evicted pod stays, phase Failed, until it is garbage-collected, and its ReplicaSet
    # has already replaced it).
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    return sorted(live, key=lambda p: (p.get("metadata") or {}).get("name", ""))


def _batches_shared(spec: Mapping[str, Any]) -> bool:
    """The pods share one batch folder (spec.runtime.batchVolumeClaim), so a pod that stops
    leaves its batches to the others instead of losing them."""
    runtime = spec.get("runtime") or {}
    return isinstance(runtime, Mapping) and bool(runtime.get("batchVolumeClaim"))


async def _rank_pods_for_scale_down(client: KubeClient, namespace: str,
                                    pods: list[dict[str, Any]], replicas: list[ReplicaSample],
                                    batches_shared: bool, logger: Any) -> bool:
    """Steer the ReplicaSet to delete idle pods, those holding batches last. False: do not
    scale down now (the ranking failed and a batch could be lost)."""
    try:
        await annotate_deletion_costs(client, namespace, pods, replicas)
    except API_ERRORS as exc:
        if not batches_shared and any(r.holds_batches for r in replicas):
            logger.warning(f"autoscaling: cannot set pod-deletion-cost ({exc}); not scaling "
                           f"down while replicas hold batch requests")
            return False
        logger.warning(f"autoscaling: cannot set pod-deletion-cost ({exc}); scaling down "
                       f"without ranking the pods")
    return True


async def _scale(client: KubeClient, namespace: str, name: str, deployment: Mapping[str, Any],
                 replicas: int) -> bool:
    """Scale `deployment` (as read at the tick's start) to `replicas`, unless its spec.replicas
    changed meanwhile (a `kubectl scale` during the scrape, up to 2 s): the decision was made
    from the old count, so False, and the next tick decides from the new one. The patch is
    guarded by the resourceVersion read; a conflict from another change (the Deployment
    controller's status writes) is retried on a fresh read."""
    before = deployment_replicas(deployment)
    for _ in range(CONFLICT_RETRIES + 1):
        try:
            await scale_deployment(client, namespace, name, replicas,
                                   resource_version=deployment["metadata"].get("resourceVersion"))
            return True
        except ApiError as exc:
            if exc.status != 409:
                raise
        fresh = await get_deployment(client, namespace, name)
        if fresh is None or deployment_replicas(fresh) != before:
            return False
        deployment = fresh
    return False


async def autoscale(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str,
                    memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """One timer tick for one LLMDeployment (see the module docstring)."""
    llmd = dict(body)
    generation = (llmd.get("metadata") or {}).get("generation")
    try:
        policy = AutoscalingPolicy.from_spec(spec.get("autoscaling"))
    except ValueError as exc:
        if memo.get(_INVALID_KEY) != str(exc):
            # Once per policy, not per tick: an error line a second for as long as the spec
            # stays as it is buried the operator's log (the reconcile reports InvalidSpec).
            memo[_INVALID_KEY] = str(exc)
            logger.error(f"autoscaling: invalid policy: {exc}")
        await _write_status(_client(), llmd, _inactive("InvalidPolicy", str(exc), generation),
                            logger)
        return
    memo.pop(_INVALID_KEY, None)
    if not policy.enabled:
        return
    if spec_refused(llmd):
        # The reconcile refused a spec and has reconciled none since (Stalled=True,
        # InvalidSpec): the children of the last applied spec stay as they are, their
        # replicas included, until a spec is applied. Scaling from the refused spec's policy
        # (or that of a newer one not checked yet) would change them.
        await _write_status(_client(), llmd, _inactive(
            "SpecRefused", "the current spec is refused (see the Stalled condition): not "
            "scaling until a spec is applied", generation), logger)
        return

    now = time.monotonic()
    state: _ObjectState | None = memo.get(_MEMO_KEY)
    stale = state is not None and now - state.last_tick > 3 * policy.scrape_interval_seconds + 10
    if state is None or stale:
        # First tick, or autoscaling was off for a while: old history must not drive decisions.
        state = _ObjectState(autoscaler=Autoscaler(policy))
        memo[_MEMO_KEY] = state
    if now - state.last_tick < policy.scrape_interval_seconds - TICK_SECONDS / 2:
        return
    state.last_tick = now
    state.autoscaler.update_policy(policy)

    client = _client()
    try:
        deployment = await get_deployment(client, namespace, name)
        if deployment is None:
            await _write_status(client, llmd, _inactive(
                "DeploymentNotFound", f"Deployment {namespace}/{name} does not exist yet",
                generation), logger)
            return
        pods = _live_pods(await list_pods(client, namespace, name))
    except API_ERRORS as exc:
        logger.warning(f"autoscaling: cannot read the Deployment or its pods: {exc}")
        return
    current = deployment_replicas(deployment) or 0

    timeout = min(2.0, max(0.2, policy.scrape_interval_seconds / 2))
    replicas = await scrape_pods(pods, timeout=timeout)
    # Requested replicas whose pods do not exist yet count as not ready (never as idle).
    replicas += [ReplicaSample(ready=False)] * max(0, current - len(replicas))
    # At zero replicas, a gateway holding requests (scale from zero) is the only demand. Above
    # zero the replicas' own metrics say it better: a stamp stays fresh for a minute after the
    # request it was for was served, and must not hold off a scale-to-zero that long.
    held = int(current == 0 and activation_requested(llmd, state.last_scale_wall, time.time()))
    t = time.monotonic()
    batches_shared = _batches_shared(spec)
    state.autoscaler.observe(MetricsSample(t=t, replicas=tuple(replicas), held_requests=held,
                                           batches_shared=batches_shared))
    decision = state.autoscaler.decide(current, now=t)

    if decision.changed:
        if decision.desired_replicas < current and not await _rank_pods_for_scale_down(
                client, namespace, pods, replicas, batches_shared, logger):
            return
        try:
            scaled = await _scale(client, namespace, name, deployment,
                                  decision.desired_replicas)
        except API_ERRORS as exc:
            logger.warning(f"autoscaling: cannot scale the Deployment: {exc}")
            return
        if not scaled:
            logger.info("autoscaling: the Deployment's replicas changed while scraping; "
                        "deciding again from them at the next tick")
            return
        state.last_scale_wall = time.time()
        direction = "ScaledUp" if decision.desired_replicas > current else "ScaledDown"
        message = (f"{current} -> {decision.desired_replicas} replicas: {decision.reason}: "
                   f"{decision.message}")
        kopf.event(body, type="Normal", reason=direction, message=message)
        logger.info(f"autoscaling: {message}")

    computed = autoscaling_status(decision, state.last_scale_wall, generation)
    await _write_status(client, llmd, computed, logger)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the timer in `registry` (done for kopf's default registry on import)."""
    kopf.timer(GROUP, VERSION, PLURAL, id=TIMER_ID, interval=TICK_SECONDS,
               when=autoscaling_enabled, registry=registry)(autoscale)


register(kopf.get_default_registry())
