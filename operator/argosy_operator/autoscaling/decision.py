"""The pure scaling decision: policy + current replicas + metric samples + state + clock -> Decision.

No I/O and no clock of its own: `now` is passed in, and everything the decision must remember
between calls (recent recommendations, panic mode, idleness) travels in `DecisionState`, which
the caller keeps and hands back on the next call. The operator's timer, `argosy autoscale-sim`
and `argosy fleet` all drive this same function.

Demand is measured in replica-equivalents over a window of samples:

    demand = max(mean_t(sum_i kv_i) / targetKV, mean_t(sum_i waiting_i) / targetQueue)

which equals current x max(avg KV / target KV, avg queue per replica / target queue) when every
replica is measured, and stays right while the replica count changes inside the window (a
per-replica average would keep counting the load of the old, smaller fleet and overshoot).

Replicas that are not ready or whose scrape failed count as 0 demand when deciding to scale UP
(new replicas are still starting; do not pile more on) and as exactly at target when deciding
to scale DOWN (a missing sample is never evidence of idleness).

Replicas holding unfinished Batch API requests (newest sample) are a floor for scaling down:
a batch lives on the replica that created it, so removing that replica would lose the batch.
When the replicas share one batch folder (`MetricsSample.batches_shared`) a stopping replica
leaves its batches to the others, so the floor is one replica while any batch is unfinished.
Which replicas go is the caller's part (the timer ranks pods by deletion cost, `argosy fleet`
drains those without batches first).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample


@dataclasses.dataclass(frozen=True)
class DecisionState:
    """What one decision hands to the next. Start with `DecisionState()`.

    recommendations: (t, raw recommended replicas) of recent decisions, for stabilization;
    observed_since: time of the first decision, or of the first sample after a gap in them
        (scale-down needs a full window of history);
    panic_until: panic mode lasts while now < panic_until;
    idle_since: start of the current fully idle stretch (scale-to-zero), None when busy;
    last_sample_t: newest sample already folded into idle_since;
    last_scale_time: when the replica count last changed.
    """

    recommendations: tuple[tuple[float, int], ...] = ()
    observed_since: float | None = None
    panic_until: float | None = None
    idle_since: float | None = None
    last_sample_t: float | None = None
    last_scale_time: float | None = None


@dataclasses.dataclass(frozen=True)
class DecisionMetrics:
    """The numbers a decision was made on (stable-window averages; None without data)."""

    kv_cache_utilization: float | None = None  # mean KV usage per measured replica, 0..1
    queue_depth: float | None = None  # mean waiting requests per measured replica
    running: float | None = None  # mean running requests per measured replica
    ready_replicas: int = 0  # in the newest sample
    measured_replicas: int = 0  # ready and scraped, in the newest sample
    demand: float | None = None  # replica-equivalents, unmeasured replicas as 0
    stable_ratio: float | None = None  # demand / current replicas, stable window
    panic_ratio: float | None = None  # demand / current replicas, panic window
    recommendation: int | None = None  # raw recommendation before stabilization and limits
    batch_pending: float | None = None  # Batch API requests not answered yet, newest sample
    batch_replicas: int = 0  # replicas holding them: the scale-down floor (1 if batches_shared)


@dataclasses.dataclass(frozen=True)
class Decision:
    """desired_replicas and why. `limited` is True when min/max, a rate limit or replicas
    holding batches cut it short."""

    current_replicas: int
    desired_replicas: int
    reason: str  # CamelCase, usable as a Kubernetes condition/event reason
    message: str
    metrics: DecisionMetrics
    panic: bool
    limited: bool
    limit_reason: str | None
    state: DecisionState

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas


# decision.limit_reason -> the reason of a decision whose limit forbade any change
_BLOCKED_REASONS = {
    "MaxReplicas": "AtMaxReplicas",
    "MinReplicas": "AtMinReplicas",
    "BatchRequests": "BatchRequestsPending",
}


@dataclasses.dataclass(frozen=True)
class _Aggregate:
    demand_low: float  # unmeasured replicas as 0
    demand_high: float  # unmeasured replicas as exactly at target
    kv: float
    queue: float
    running: float | None


# Each replica's gauges are finite, but absurd ones (1e308 waiting requests) summed over the
# replicas overflow to inf, which neither math.ceil nor a JSON status can hold. No aggregate
# needs to exceed the most replicas a Deployment can have (spec.replicas is an int32).
_MAX_AGGREGATE = float(2**31 - 1)


def _cap(x: float) -> float:
    return min(x, _MAX_AGGREGATE)


def _aggregate(policy: AutoscalingPolicy, samples: Sequence[MetricsSample]) -> _Aggregate | None:
    usable = [s for s in samples if s.num_measured > 0]
    if not usable:
        return None
    n = len(usable)
    sum_kv = sum_wait = 0.0
    kv_per = wait_per = run_per = 0.0
    run_known = True
    max_unmeasured = 0
    for s in usable:
        measured = [r for r in s.replicas if r.is_measured]
        skv = sum(r.kv_cache_usage or 0.0 for r in measured)
        swait = sum(r.num_waiting or 0.0 for r in measured)
        sum_kv += skv
        sum_wait += swait
        kv_per += skv / len(measured)
        wait_per += swait / len(measured)
        if any(r.num_running is None for r in measured):
            run_known = False
        else:
            run_per += sum(r.num_running or 0.0 for r in measured) / len(measured)
        max_unmeasured = max(max_unmeasured, s.num_unmeasured)
    demand = max(sum_kv / n / policy.target_kv_cache_utilization,
                 sum_wait / n / policy.target_queue_depth)
    return _Aggregate(
        demand_low=_cap(demand),
        # The most replicas that were missing at any point in the window, each at target.
        demand_high=_cap(demand + max_unmeasured),
        kv=_cap(kv_per / n),
        queue=_cap(wait_per / n),
        running=_cap(run_per / n) if run_known else None,
    )


def _in_window(samples: Sequence[MetricsSample], now: float, seconds: float) -> list[MetricsSample]:
    return [s for s in samples if now - seconds < s.t <= now]


def decide(
    policy: AutoscalingPolicy,
    current_replicas: int,
    samples: Sequence[MetricsSample],
    state: DecisionState,
    now: float,
) -> Decision:
    """Decide the replica count at time `now`.

    policy: the deployment's `AutoscalingPolicy`; current_replicas: replicas that exist (or are
    requested) now; samples: scrape rounds, oldest first, covering at least the stable window
    (older ones are ignored); state: the previous decision's `state` (or `DecisionState()`);
    now: seconds on the same clock as the samples' `t`. Pure: same inputs, same output.
    """
    if current_replicas < 0:
        raise ValueError(f"current_replicas: must be >= 0, got {current_replicas}")
    samples = [s for s in samples if s.t <= now]

    # Fold samples not seen yet into the idle stretch (scale-to-zero bookkeeping). A gap of
    # more than the stable window between two samples (the sample age the decision trusts)
    # is time nothing was seen, the API server unreachable say: neither idleness nor a
    # watched window, so both start again after it, as after an operator restart.
    idle_since = state.idle_since
    last_sample_t = state.last_sample_t
    observed_since = state.observed_since
    # Samples come every scrapeIntervalSeconds, which the CRD allows to exceed the stable
    # window: then every sample followed a "gap", and the scale-down window and the idle
    # clock restarted at each one (never a scale-down, never zero). Only a missed sample
    # beyond that is a gap.
    gap = max(policy.stable_window_seconds, 2 * policy.scrape_interval_seconds)
    previous: MetricsSample | None = None
    for s in samples:
        if last_sample_t is None or s.t > last_sample_t:
            if last_sample_t is not None and s.t - last_sample_t > gap:
                idle_since, observed_since = None, s.t
            idle = s.is_idle_since(previous)
            idle_since = (idle_since if idle_since is not None else s.t) if idle else None
            last_sample_t = s.t
        previous = s
    if observed_since is None:
        observed_since = now
    base = dataclasses.replace(state, observed_since=observed_since, idle_since=idle_since,
                               last_sample_t=last_sample_t)

    latest = samples[-1] if samples else None
    holding_batches = latest.num_holding_batches if latest else 0
    batch_floor = latest.batch_floor if latest else 0

    def finish(target: int, reason: str, message: str, metrics: DecisionMetrics, panic: bool,
               new_state: DecisionState) -> Decision:
        # Rate limits, the replicas holding batches, then [min, max]; any of them cutting
        # `target` short marks it limited.
        desired, limit_reason = target, None
        if desired > current_replicas:
            up_limit = max(current_replicas + 1, math.floor(current_replicas * policy.max_scale_up_rate))
            if desired > up_limit:
                desired, limit_reason = up_limit, "ScaleUpRate"
        elif desired < current_replicas:
            down_limit = min(current_replicas - 1,
                             math.ceil(current_replicas * policy.max_scale_down_rate))
            if desired < down_limit:
                desired, limit_reason = down_limit, "ScaleDownRate"
            if desired < batch_floor:
                desired, limit_reason = min(current_replicas, batch_floor), "BatchRequests"
        if desired > policy.max_replicas:
            desired, limit_reason = policy.max_replicas, "MaxReplicas"
        if desired < policy.min_replicas:
            desired, limit_reason = policy.min_replicas, "MinReplicas"
        if desired != target and target != current_replicas and desired == current_replicas:
            # Wanted a change the limits forbid entirely (already at max/min, or every
            # replica that would go holds a batch).
            reason = _BLOCKED_REASONS[limit_reason or "MinReplicas"]
            if limit_reason == "BatchRequests":
                holders = ("a replica must stay to run the shared batches"
                           if latest and latest.batches_shared else
                           f"{holding_batches} replica(s) hold unfinished Batch API requests")
                message = f"{holders}; {message}"
        elif desired > current_replicas and target <= current_replicas:
            reason, message = "BelowMinReplicas", f"raised to minReplicas {policy.min_replicas}"
        elif desired < current_replicas and target >= current_replicas:
            reason, message = "AboveMaxReplicas", f"lowered to maxReplicas {policy.max_replicas}"
        if desired != current_replicas:
            new_state = dataclasses.replace(new_state, last_scale_time=now)
        return Decision(current_replicas=current_replicas, desired_replicas=desired, reason=reason,
                        message=message, metrics=metrics, panic=panic,
                        limited=limit_reason is not None and desired != target,
                        limit_reason=limit_reason if desired != target else None, state=new_state)

    ready = sum(1 for r in latest.replicas if r.ready) if latest else 0
    measured = latest.num_measured if latest else 0
    if current_replicas == 0:
        # Nothing runs, so the only demand is requests a gateway holds for want of a replica:
        # wake one (more would each pay a cold start before any of them is known to be needed;
        # once it serves, the normal decision scales on its load).
        held = latest.held_requests if latest and now - latest.t <= policy.stable_window_seconds else 0
        if held:
            return finish(1, "ScaleFromZero", f"{held} request(s) held at the gateway",
                          DecisionMetrics(), False, base)
        return finish(0, "ScaledToZero", "no replicas; waiting for demand",
                      DecisionMetrics(), False, base)

    stable = _aggregate(policy, _in_window(samples, now, policy.stable_window_seconds))
    if latest is None or measured == 0 or now - latest.t > policy.stable_window_seconds or stable is None:
        # No trustworthy data right now: hold (never scale down on missing samples).
        blind = base
        if stable is None:
            # Nothing measured for a whole stable window (every scrape failed, every pod
            # unready): as blind as a gap without samples, so the scale-down window starts
            # again after it. Otherwise the recommendations from before had aged out and the
            # first low sample afterwards scaled down at once (8 -> 4), unstabilized.
            blind = dataclasses.replace(base, observed_since=now)
        return finish(current_replicas, "NoMetrics",
                      f"no ready replica could be scraped ({ready} ready of {current_replicas})",
                      DecisionMetrics(ready_replicas=ready, measured_replicas=measured), False,
                      blind)
    panic_agg = _aggregate(policy, _in_window(samples, now, policy.panic_window_seconds))
    panic_ratio = panic_agg.demand_low / current_replicas if panic_agg else None
    stable_ratio = stable.demand_low / current_replicas

    panic_until = state.panic_until
    if panic_ratio is not None and panic_ratio >= policy.panic_threshold:
        # Knative-style: stay in panic for a full stable window after the last panic signal.
        panic_until = now + policy.stable_window_seconds
    panicking = panic_until is not None and now < panic_until

    idle_long = (policy.min_replicas == 0 and idle_since is not None
                 and now - idle_since >= policy.scale_to_zero_idle_seconds)
    if stable_ratio > 1.0 + policy.tolerance:
        recommendation = math.ceil(stable.demand_low - 1e-9)
    elif stable.demand_high / current_replicas < 1.0 - policy.tolerance:
        recommendation = math.ceil(stable.demand_high - 1e-9)
    else:
        recommendation = current_replicas
    if recommendation < 1:
        recommendation = 0 if idle_long else 1

    keep = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    recs = tuple((t, r) for t, r in state.recommendations if now - t < keep and t < now)
    recs = recs + ((now, recommendation),)

    def in_window(t: float, seconds: float) -> bool:
        # The last `seconds`, (now - seconds, now], as `keep` prunes and the metric windows
        # count (an edge inclusive here made the result depend on the other window's length).
        return t == now or now - t < seconds

    up_floor = min(r for t, r in recs if in_window(t, policy.scale_up_stabilization_seconds))
    down_ceiling = max(r for t, r in recs
                       if in_window(t, policy.scale_down_stabilization_seconds))
    if now - observed_since < policy.scale_down_stabilization_seconds:
        down_ceiling = max(down_ceiling, current_replicas)  # not watched long enough to go down

    metrics = DecisionMetrics(
        kv_cache_utilization=stable.kv, queue_depth=stable.queue, running=stable.running,
        ready_replicas=ready, measured_replicas=measured, demand=stable.demand_low,
        stable_ratio=stable_ratio, panic_ratio=panic_ratio, recommendation=recommendation,
        batch_pending=sum(r.batch_pending or 0.0 for r in latest.replicas if r.is_measured),
        batch_replicas=holding_batches)
    new_state = dataclasses.replace(base, recommendations=recs, panic_until=panic_until)
    load = (f"demand {stable.demand_low:.2f} replicas (kv {stable.kv:.2f}, "
            f"queue {stable.queue:.2f}/replica) on {current_replicas}")

    if panicking:
        panic_target = math.ceil(panic_agg.demand_low - 1e-9) if panic_agg else current_replicas
        target = max(current_replicas, up_floor, panic_target)
        if target > current_replicas:
            return finish(target, "PanicScaleUp",
                          f"panic: short-window load {panic_ratio or 0:.2f}x target; {load}",
                          metrics, True, new_state)
        return finish(current_replicas, "PanicHold",
                      f"panic mode holds replicas (no scale-down while panicking); {load}",
                      metrics, True, new_state)
    if idle_long and current_replicas > 0:
        return finish(0, "ScaleToZero",
                      f"idle for {now - (idle_since or now):.0f}s >= scaleToZeroIdleSeconds",
                      metrics, False, new_state)
    if up_floor > current_replicas:
        return finish(up_floor, "ScaleUp", load, metrics, False, new_state)
    if recommendation > current_replicas:
        return finish(current_replicas, "ScaleUpStabilizing",
                      f"waiting out scaleUpStabilizationSeconds; {load}", metrics, False, new_state)
    if down_ceiling < current_replicas:
        return finish(down_ceiling, "ScaleDown", load, metrics, False, new_state)
    if recommendation < current_replicas:
        return finish(current_replicas, "ScaleDownStabilizing",
                      f"lower demand must last scaleDownStabilizationSeconds; {load}",
                      metrics, False, new_state)
    return finish(current_replicas, "WithinTolerance", load, metrics, False, new_state)
