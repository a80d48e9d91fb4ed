"""Table tests of the pure decision function, with an injected clock (closed loop, 5 s ticks)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from argosy_operator.autoscaling import (
    AutoscalingPolicy,
    DecisionState,
    MetricsSample,
    ReplicaSample,
    decide,
)
from autoscaling_scenarios import first_change, fleet_sample, run_closed_loop
from hypothesis import given, settings
from hypothesis import strategies as st

POLICY = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=10)  # other fields: defaults
TARGET_Q = 4.0  # the contract's default targetQueueDepth
TARGET_KV = 0.7  # the contract's default targetKVCacheUtilization


def test_steady_noisy_load_inside_tolerance_never_changes_replicas() -> None:
    rng = random.Random(7)
    # 3 replicas' worth of queue with +-8% noise (tolerance is 10%), KV at 60% of target.
    ticks = run_closed_loop(
        POLICY, lambda t: (3 * TARGET_Q * rng.uniform(0.92, 1.08), 3 * TARGET_KV * 0.6),
        start_replicas=3, duration=3600)
    assert {k.desired for k in ticks} == {3}
    assert all(k.decision.reason == "WithinTolerance" for k in ticks)


@pytest.mark.parametrize("kind", ["queue", "kv"])
def test_sustained_load_scales_up_within_stable_window(kind: str) -> None:
    onset = 300.0

    def demand(t: float) -> tuple[float, float]:
        level = 1.0 if t < onset else 1.6  # 60% over target: real, but below panic (2x)
        if kind == "queue":
            return 2 * TARGET_Q * level, 0.2
        return 0.0, 2 * TARGET_KV * level

    ticks = run_closed_loop(POLICY, demand, start_replicas=2, duration=900)
    change = first_change(ticks)
    assert change is not None and onset < change.t <= onset + POLICY.stable_window_seconds
    assert change.desired > 2
    assert change.decision.reason == "ScaleUp" and not change.decision.panic
    # Once settled, 3.2 replicas' worth of load per replica is inside the tolerance band (or
    # the replica count is the next integer up), and it stays there.
    final = ticks[-1].current
    assert abs(3.2 / final - 1) <= POLICY.tolerance or final == 4
    assert all(k.desired == ticks[-1].current for k in ticks if k.t > onset + 2 * 60)


def test_spike_triggers_panic_scale_up_at_once() -> None:
    onset = 300.0
    ticks = run_closed_loop(
        POLICY, lambda t: ((2 if t < onset else 12) * TARGET_Q, 0.0),  # 6x target
        start_replicas=2, duration=600)
    at_onset = next(k for k in ticks if k.t == onset)
    assert at_onset.decision.panic and at_onset.decision.reason == "PanicScaleUp"
    # x2 per decision at most (maxScaleUpRate), so 2 -> 4 at once, then 8, then >= 10 capped.
    assert at_onset.desired == 4 and at_onset.decision.limit_reason == "ScaleUpRate"
    assert [k.desired for k in ticks if onset <= k.t <= onset + 10] == [4, 8, 10]
    assert all(k.desired <= POLICY.max_replicas for k in ticks)


def test_load_drop_scales_down_only_after_stabilization_window() -> None:
    drop = 600.0
    ticks = run_closed_loop(
        POLICY, lambda t: ((6 if t < drop else 1) * TARGET_Q, 0.0),
        start_replicas=6, duration=1500)
    assert all(k.desired == 6 for k in ticks if k.t < drop)
    down = first_change(ticks, after=drop)
    assert down is not None and down.desired < 6 and down.decision.reason == "ScaleDown"
    window = POLICY.scale_down_stabilization_seconds
    # Not before the stabilization window has seen lower demand throughout, not much later.
    assert drop + window <= down.t <= drop + window + POLICY.stable_window_seconds
    stabilizing = [k for k in ticks if drop < k.t < down.t]
    assert any(k.decision.reason == "ScaleDownStabilizing" for k in stabilizing)
    # At most halving per decision (maxScaleDownRate 0.5), and it ends at the demand: 1 replica.
    assert 3 <= down.desired < 6
    assert all(k.desired >= k.current / 2 for k in ticks)
    assert ticks[-1].current == 1


def test_oscillating_load_does_not_flap() -> None:
    # Square wave: 60 s at 1.5x target on 2 replicas, 60 s at 0.4x, for an hour.
    ticks = run_closed_loop(
        POLICY, lambda t: ((3.0 if (t // 60) % 2 == 0 else 0.8) * TARGET_Q, 0.0),
        start_replicas=2, duration=3600)
    changes = [(k.current, k.desired) for k in ticks if k.desired != k.current]
    assert changes, "the high phase must scale up"
    ups = [c for c in changes if c[1] > c[0]]
    downs = [c for c in changes if c[1] < c[0]]
    assert len(ups) <= 2 and downs == []


@pytest.mark.parametrize("breakage", ["failed", "unready"])
def test_failed_scrapes_and_unready_replicas_never_cause_scale_down(breakage: str) -> None:
    # 4 replicas; the first 2 are broken the whole time (a scale-down would remove healthy ones
    # too, so they stay), the other 2 carry 0.3x target between them.
    def broken(t: float, i: int) -> str | None:
        return breakage if i < 2 else None

    ticks = run_closed_loop(POLICY, lambda t: (2 * TARGET_Q * 0.3, 0.0), start_replicas=4,
                            duration=1800, broken=broken)
    # The measured pair alone needs 1 replica; the broken pair counts as fully loaded (2 more):
    # the fleet may lose the idle replica's share only.
    assert min(k.desired for k in ticks) == 3
    # Every replica broken: no data, no change at all.
    ticks = run_closed_loop(POLICY, lambda t: (0.0, 0.0), start_replicas=4, duration=1800,
                            broken=lambda t, i: breakage)
    assert {k.desired for k in ticks} == {4}
    assert {k.decision.reason for k in ticks} == {"NoMetrics"}


def _idle_replica() -> ReplicaSample:
    return ReplicaSample(kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0)


@settings(max_examples=80, deadline=None)
@given(
    loads=st.lists(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 30)), min_size=2, max_size=6),
                   min_size=1, max_size=20),
    broken_index=st.integers(0, 5), kind=st.sampled_from(["failed", "unready"]),
    start=st.integers(1, 8),
)
def test_a_missing_sample_never_decides_lower_than_an_idle_one(
        loads: list[list[tuple[float, float]]], broken_index: int, kind: str, start: int) -> None:
    # Same history twice: once replica `broken_index` is measured idle, once it is missing.
    policy = AutoscalingPolicy(enabled=True, max_replicas=12, scale_down_stabilization_seconds=0)
    idle_hist, broken_hist = [], []
    for k, row in enumerate(loads):
        replicas = [ReplicaSample(kv_cache_usage=kv, num_waiting=w, num_running=1.0)
                    for kv, w in row]
        i = broken_index % len(replicas)
        idle, missing = list(replicas), list(replicas)
        idle[i] = _idle_replica()
        missing[i] = ReplicaSample(ready=kind != "unready")
        idle_hist.append(MetricsSample(t=5.0 * k, replicas=tuple(idle)))
        broken_hist.append(MetricsSample(t=5.0 * k, replicas=tuple(missing)))
    now = 5.0 * (len(loads) - 1)
    state = DecisionState(observed_since=-1000.0)
    with_idle = decide(policy, start, idle_hist, state, now)
    with_missing = decide(policy, start, broken_hist, state, now)
    assert with_missing.desired_replicas >= with_idle.desired_replicas


def test_missing_samples_do_not_look_idle() -> None:
    # An idle, measured fleet of 4 scales down to 1; the same fleet whose scrapes all fail
    # after t=100 (before the stabilization window allowed any scale-down) stays at 4.
    idle = run_closed_loop(POLICY, lambda t: (0.0, 0.0), start_replicas=4, duration=900)
    assert idle[-1].current == 1
    flaky = run_closed_loop(POLICY, lambda t: (0.0, 0.0), start_replicas=4, duration=900,
                            broken=lambda t, i: "failed" if t >= 100 else None)
    assert {k.desired for k in flaky} == {4}


def test_unready_replicas_do_not_inflate_scale_up() -> None:
    # Right after a scale-up, new replicas are unready; the load on the ready ones (2x target on
    # 2 ready of 4) is exactly what 4 replicas absorb: no further scale-up.
    policy = AutoscalingPolicy(enabled=True, max_replicas=10, panic_threshold=3.0)
    ticks = run_closed_loop(policy, lambda t: (4 * TARGET_Q, 0.0), start_replicas=4,
                            duration=300, broken=lambda t, i: "unready" if i >= 2 else None)
    assert {k.desired for k in ticks} == {4}


@settings(max_examples=60, deadline=None)
@given(
    min_r=st.integers(0, 3), span=st.integers(0, 5), start=st.integers(0, 12),
    seed=st.integers(0, 2**16),
)
def test_min_max_always_respected(min_r: int, span: int, start: int, seed: int) -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=min_r, max_replicas=max(1, min_r + span),
                               scale_down_stabilization_seconds=30, scale_to_zero_idle_seconds=60)
    rng = random.Random(seed)
    ticks = run_closed_loop(
        policy, lambda t: (rng.choice([0, 0, 1, 10, 100]) * rng.random(), rng.random() * 3),
        start_replicas=start, duration=400,
        broken=lambda t, i: rng.choice([None, None, None, "failed", "unready"]))
    for k in ticks:
        assert policy.min_replicas <= k.desired <= policy.max_replicas
        if policy.min_replicas <= k.current <= policy.max_replicas and k.desired > k.current:
            assert k.desired <= max(k.current + 1, math.floor(k.current * 2.0))
        if policy.min_replicas <= k.current <= policy.max_replicas and k.desired < k.current:
            assert k.desired >= min(k.current - 1, math.ceil(k.current * 0.5))


def test_out_of_range_current_is_clamped_immediately() -> None:
    sample = fleet_sample(0.0, 12, 12 * TARGET_Q, 0.0)
    d = decide(POLICY, 12, [sample], DecisionState(), now=0.0)
    assert d.desired_replicas == POLICY.max_replicas and d.reason == "AboveMaxReplicas"
    policy = AutoscalingPolicy(enabled=True, min_replicas=3, max_replicas=5)
    d = decide(policy, 1, [fleet_sample(0.0, 1, 0.0, 0.0)], DecisionState(), now=0.0)
    assert d.desired_replicas == 3 and d.reason == "BelowMinReplicas" and d.limited


def test_at_max_reports_limited() -> None:
    ticks = run_closed_loop(POLICY, lambda t: (40 * TARGET_Q, 0.0), start_replicas=10, duration=30)
    assert all(k.desired == 10 for k in ticks)
    assert ticks[-1].decision.reason == "AtMaxReplicas"
    assert ticks[-1].decision.limit_reason == "MaxReplicas"


def test_scale_to_zero_after_idle_period_only_with_min_zero() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4)
    busy_until = 200.0
    ticks = run_closed_loop(policy, lambda t: (TARGET_Q if t < busy_until else 0.0, 0.0),
                            start_replicas=1, duration=1200)
    zero = first_change(ticks, after=busy_until)
    assert zero is not None and zero.desired == 0 and zero.decision.reason == "ScaleToZero"
    # The first idle sample is the one at t=busy_until; zero only after the whole idle period.
    assert zero.t >= busy_until + policy.scale_to_zero_idle_seconds
    assert zero.t <= busy_until + policy.scale_to_zero_idle_seconds + 5
    assert all(k.desired == 0 for k in ticks if k.t > zero.t)
    # minReplicas 1: the same idle trace never goes below 1.
    ticks = run_closed_loop(POLICY, lambda t: (TARGET_Q if t < busy_until else 0.0, 0.0),
                            start_replicas=1, duration=1200)
    assert {k.desired for k in ticks} == {1}


def test_scale_to_zero_needs_every_replica_measured_idle() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4)
    ticks = run_closed_loop(policy, lambda t: (0.0, 0.0), start_replicas=1, duration=1200,
                            broken=lambda t, i: "failed" if int(t) % 300 == 0 else None)
    assert 0 not in {k.desired for k in ticks}  # a failed scrape every 5 minutes resets idleness


def test_replicas_holding_batches_are_a_floor_for_scaling_down() -> None:
    # An idle fleet of 4 where replicas 0 and 1 hold Batch API requests until t=1000 (the
    # loop removes the highest indices, as a caller that ranks by batches would): it may
    # shrink to 2 but no further until the batches are done.
    done = 1000.0
    ticks = run_closed_loop(POLICY, lambda t: (0.0, 0.0), start_replicas=4, duration=1800,
                            batches=lambda t, i: 50.0 if t < done and i < 2 else 0.0)
    assert min(k.desired for k in ticks if k.t < done) == 2
    held = [k for k in ticks if k.t < done and k.current == 2 and k.t > 400]
    assert held and all(k.desired == 2 for k in held)
    assert {k.decision.reason for k in held} == {"BatchRequestsPending"}
    d = held[-1].decision
    assert d.limited and d.limit_reason == "BatchRequests"
    assert "2 replica(s) hold unfinished Batch API requests" in d.message
    assert d.metrics.batch_replicas == 2 and d.metrics.batch_pending == 100.0
    assert ticks[-1].current == 1 and ticks[-1].decision.metrics.batch_replicas == 0


def test_a_partial_scale_down_stops_at_the_replicas_holding_batches() -> None:
    # 6 idle replicas, 3 of them with batches; the rate limit alone would allow 6 -> 3 anyway,
    # so use 8 -> 4 (rate limit) with 5 holding batches: 8 -> 5, limited by the batches.
    policy = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=10,
                               scale_down_stabilization_seconds=0)
    samples = [fleet_sample(float(t), 8, 0.0, 0.0, batches=lambda t, i: float(i < 5))
               for t in range(0, 65, 5)]
    d = decide(policy, 8, samples, DecisionState(observed_since=0.0), now=60.0)
    assert d.desired_replicas == 5 and d.reason == "ScaleDown"
    assert d.limited and d.limit_reason == "BatchRequests"


def test_with_a_shared_batch_folder_one_replica_is_enough_for_the_batches() -> None:
    # The same 8 replicas, 5 holding batches, but sharing one folder: a replica that stops
    # leaves its batches to the others, so only the rate limit (8 -> 4) applies...
    policy = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=10,
                               scale_down_stabilization_seconds=0)
    samples = [dataclasses.replace(fleet_sample(float(t), 8, 0.0, 0.0,
                                                batches=lambda t, i: float(i < 5)),
                                   batches_shared=True) for t in range(0, 65, 5)]
    d = decide(policy, 8, samples, DecisionState(observed_since=0.0), now=60.0)
    assert d.desired_replicas == 4 and d.limit_reason == "ScaleDownRate"
    assert d.metrics.batch_replicas == 5
    # ...and the floor is one replica while any batch is unfinished.
    assert samples[-1].batch_floor == 1
    assert dataclasses.replace(samples[-1], batches_shared=False).batch_floor == 5
    idle = fleet_sample(0.0, 3, 0.0, 0.0)
    assert dataclasses.replace(idle, batches_shared=True).batch_floor == 0


def test_no_scale_to_zero_while_a_batch_is_pending() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4)
    done = 1500.0
    ticks = run_closed_loop(policy, lambda t: (0.0, 0.0), start_replicas=1, duration=2400,
                            batches=lambda t, i: 3.0 if t < done else 0.0)
    assert all(k.desired == 1 for k in ticks if k.t < done)
    zero = first_change(ticks, after=done)
    assert zero is not None and zero.desired == 0 and zero.decision.reason == "ScaleToZero"
    assert zero.t >= done + policy.scale_to_zero_idle_seconds


def test_an_unmeasured_replica_is_not_known_to_hold_batches() -> None:
    # A failed scrape carries no batch count: holds_batches is about measured replicas only.
    assert not ReplicaSample(ready=True).holds_batches
    assert not ReplicaSample(ready=False, batch_pending=3.0).holds_batches
    assert ReplicaSample(kv_cache_usage=0.0, num_waiting=0, num_running=0,
                         batch_pending=3.0).holds_batches


def test_scale_up_stabilization_delays_scale_up() -> None:
    policy = AutoscalingPolicy(enabled=True, max_replicas=10, scale_up_stabilization_seconds=60)
    onset = 100.0
    ticks = run_closed_loop(policy, lambda t: ((2 if t < onset else 3.2) * TARGET_Q, 0.0),
                            start_replicas=2, duration=600)
    change = first_change(ticks)
    assert change is not None and change.t >= onset + 60
    assert any(k.decision.reason == "ScaleUpStabilizing" for k in ticks if k.t < change.t)


def test_decision_is_pure_and_ignores_future_samples() -> None:
    samples = [fleet_sample(float(t), 2, 8.0, 0.2) for t in range(0, 60, 5)]
    future = samples + [fleet_sample(100.0, 2, 1000.0, 2.0)]
    a = decide(POLICY, 2, samples, DecisionState(), now=55.0)
    b = decide(POLICY, 2, future, DecisionState(), now=55.0)
    assert a == b
    assert decide(POLICY, 2, samples, DecisionState(), now=55.0) == a


def test_stale_samples_mean_no_metrics() -> None:
    old = [fleet_sample(0.0, 2, 0.0, 0.0)]
    d = decide(POLICY, 2, old, DecisionState(), now=POLICY.stable_window_seconds + 1)
    assert d.reason == "NoMetrics" and d.desired_replicas == 2


def test_reported_metrics_are_stable_window_averages() -> None:
    # Replica 0: kv 0.2, waiting 1; replica 1: kv 0.6, waiting 5 -> mean kv 0.4, queue 3.
    sample = MetricsSample(t=0.0, replicas=(
        ReplicaSample(kv_cache_usage=0.2, num_waiting=1, num_running=3),
        ReplicaSample(kv_cache_usage=0.6, num_waiting=5, num_running=1),
        ReplicaSample(ready=False)))
    d = decide(POLICY, 3, [sample], DecisionState(), now=0.0)
    assert d.metrics.kv_cache_utilization == pytest.approx(0.4)
    assert d.metrics.queue_depth == pytest.approx(3.0)
    assert d.metrics.running == pytest.approx(2.0)
    assert (d.metrics.ready_replicas, d.metrics.measured_replicas) == (2, 2)
    assert d.metrics.demand == pytest.approx(max(0.8 / TARGET_KV, 6 / TARGET_Q))


def test_held_requests_wake_a_deployment_at_zero_with_one_replica() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4)
    state = DecisionState()
    quiet = decide(policy, 0, [MetricsSample(t=0.0, replicas=())], state, now=0.0)
    assert (quiet.desired_replicas, quiet.reason) == (0, "ScaledToZero")
    # However many are held, one replica first: each more would pay a cold start on a guess.
    woken = decide(policy, 0, [MetricsSample(t=5.0, replicas=(), held_requests=50)],
                   quiet.state, now=5.0)
    assert (woken.desired_replicas, woken.reason) == (1, "ScaleFromZero")
    assert "50 request(s) held" in woken.message
    # A held count from a sample older than the stable window is no evidence of demand now.
    stale = decide(policy, 0, [MetricsSample(t=5.0, replicas=(), held_requests=50)],
                   quiet.state, now=5.0 + policy.stable_window_seconds + 1)
    assert stale.desired_replicas == 0


def test_held_requests_keep_a_deployment_from_scaling_to_zero() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4,
                               scale_to_zero_idle_seconds=30)
    idle = ReplicaSample(ready=True, kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0)
    assert MetricsSample(t=0, replicas=(idle,)).is_idle
    assert not MetricsSample(t=0, replicas=(idle,), held_requests=1).is_idle
    state, samples = DecisionState(), []
    for t in range(0, 120, 5):
        # A gateway holds a request every 20 s (its replica keeps failing to be ready for it).
        samples.append(MetricsSample(t=float(t), replicas=(idle,), held_requests=int(t % 20 == 0)))
        decision = decide(policy, 1, samples, state, now=float(t))
        state = decision.state
        assert decision.desired_replicas == 1
    with pytest.raises(ValueError, match="held_requests"):
        MetricsSample(t=0, replicas=(), held_requests=-1)
