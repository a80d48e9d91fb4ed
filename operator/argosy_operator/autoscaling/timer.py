"""The kopf timer that autoscales each LLMDeployment with `spec.autoscaling.enabled: true`.

Every tick (ARGOSY_AUTOSCALE_TICK_SECONDS, default 1 s; each object is scraped only every
`scrapeIntervalSeconds`, which kopf timers cannot vary per object): read the Deployment (same
name and namespace as the LLMDeployment), list its pods by the Deployment's selector, scrape
the ready ones concurrently, feed the per-object `Autoscaler`, and when the decision changes the
replica count, merge-patch the Deployment's `spec.replicas` and post an Event. The status
(desiredReplicas, lastScaleTime, metrics, ScalingActive/ScalingLimited) is written through
kopf's `patch`, only when it differs from what this timer last wrote.

With autoscaling disabled the `when` filter keeps the timer from running at all, so
`kubectl scale llmd` (the scale subresource) is the only thing that sets replicas.
State lives in kopf's per-object `memo`: an operator restart starts a fresh window, which only
delays scale-downs (a full stabilization window must be observed first).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf

from argosy_operator.autoscaling import kube_api
from argosy_operator.autoscaling.autoscaler import Autoscaler
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample, ReplicaSample
from argosy_operator.autoscaling.scraper import scrape_pods
from argosy_operator.autoscaling.status import (
    SCALING_ACTIVE,
    SCALING_LIMITED,
    build_status,
    condition,
    merge_conditions,
    rfc3339,
)
from argosy_operator.builders.common import selector_labels
from argosy_operator.constants import GROUP, PLURAL, VERSION

TIMER_ID = "autoscaling"
TICK_SECONDS = float(os.environ.get("ARGOSY_AUTOSCALE_TICK_SECONDS", "1.0"))
_MEMO_KEY = "argosy_autoscaling"


@dataclasses.dataclass
class _ObjectState:
    """What the timer keeps per LLMDeployment between ticks (in kopf's memo)."""

    autoscaler: Autoscaler
    last_tick: float = float("-inf")  # monotonic
    last_status: dict[str, Any] | None = None
    last_scale_wall: float | None = None


def autoscaling_enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf `when` filter: run only for objects with autoscaling enabled."""
    autoscaling = spec.get("autoscaling") or {}
    return isinstance(autoscaling, Mapping) and autoscaling.get("enabled") is True


def _pods_of(pod_list: Mapping[str, Any], match_labels: Mapping[str, str]) -> list[dict[str, Any]]:
    # Filter client-side as well: the selector is the contract, whoever serves the list.
    out = []
    for pod in pod_list.get("items") or []:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("deletionTimestamp"):
            continue  # terminating: neither capacity nor demand any more
        if all(labels.get(k) == v for k, v in match_labels.items()):
            out.append(pod)
    return sorted(out, key=lambda p: p["metadata"].get("name", ""))


async def autoscale(
    body: kopf.Body, spec: kopf.Spec, status: kopf.Status, name: str, namespace: str,
    memo: kopf.Memo, patch: kopf.Patch, logger: Any, **_: Any,
) -> None:
    """One timer tick for one LLMDeployment (see the module docstring)."""
    try:
        policy = AutoscalingPolicy.from_spec(spec.get("autoscaling"))
    except ValueError as exc:
        _write_conditions(status, patch, [condition(SCALING_ACTIVE, False, "InvalidPolicy", str(exc))])
        logger.error(f"autoscaling: invalid policy: {exc}")
        return
    if not policy.enabled:
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

    try:
        deployment = await kube_api.get(kube_api.deployment_path(namespace, name), logger)
    except kube_api.NotFound:
        _write_conditions(status, patch, [condition(
            SCALING_ACTIVE, False, "DeploymentNotFound", f"Deployment {namespace}/{name} not found")])
        return
    dep_spec = deployment.get("spec") or {}
    current = int(dep_spec.get("replicas", 1))
    match_labels = (dep_spec.get("selector") or {}).get("matchLabels") or selector_labels(name)
    try:
        pod_list = await kube_api.get(kube_api.pods_path(namespace, match_labels), logger)
    except kube_api.ApiError as exc:
        logger.warning(f"autoscaling: cannot list pods, skipping this tick: {exc}")
        return
    pods = _pods_of(pod_list, match_labels)

    timeout = min(2.0, max(0.2, policy.scrape_interval_seconds / 2))
    replicas = await scrape_pods(pods, timeout=timeout)
    # Requested replicas whose pods do not exist yet count as not ready (never as idle).
    replicas += [ReplicaSample(ready=False)] * max(0, current - len(replicas))
    t = time.monotonic()
    state.autoscaler.observe(MetricsSample(t=t, replicas=tuple(replicas)))
    decision = state.autoscaler.decide(current, now=t)
    wall = time.time()

    if decision.changed:
        await kube_api.merge_patch(kube_api.deployment_path(namespace, name),
                                   {"spec": {"replicas": decision.desired_replicas}}, logger)
        state.last_scale_wall = wall
        direction = "ScaledUp" if decision.desired_replicas > current else "ScaledDown"
        message = (f"{current} -> {decision.desired_replicas} replicas: {decision.reason}: "
                   f"{decision.message}")
        kopf.event(body, type="Normal", reason=direction, message=message)
        logger.info(f"autoscaling: {message}")

    last_scale = state.last_scale_wall
    new_status = build_status(decision, status, wall, last_scale)
    if last_scale is None:
        new_status.pop("lastScaleTime", None)  # keep whatever an earlier operator wrote
    if _material(new_status) != _material(state.last_status):
        for key, value in new_status.items():
            patch.status[key] = value
        state.last_status = new_status


def _material(status: Mapping[str, Any] | None) -> Any:
    """The status without timestamps: writing only on real changes spares the API server."""
    if status is None:
        return None
    out = {k: v for k, v in status.items() if k != "autoscaling"}
    out["autoscaling"] = {k: v for k, v in (status.get("autoscaling") or {}).items() if k != "time"}
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                         for c in status.get("conditions") or []]
    return out


def _write_conditions(status: Mapping[str, Any], patch: kopf.Patch,
                      updates: list[dict[str, str]]) -> None:
    existing = status.get("conditions") or []
    if any(c.get("type") == SCALING_LIMITED for c in existing):
        updates = updates + [condition(SCALING_LIMITED, False, "ScalingInactive",
                                       "the autoscaler could not compute a decision")]
    merged = merge_conditions(existing, updates, rfc3339(time.time()))
    if merged != [dict(c) for c in existing]:
        patch.status["conditions"] = merged


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the timer in `registry` (done for kopf's default registry on import)."""
    kopf.timer(GROUP, VERSION, PLURAL, id=TIMER_ID, interval=TICK_SECONDS,
               when=autoscaling_enabled, registry=registry)(autoscale)


register(kopf.get_default_registry())
