"""Gaps in the samples: a stretch with no sample at all (the API server unreachable, a tick
that could not list the pods) is a time nothing was seen, so it is neither idleness nor a
watched scale-down window; the decision restarts both after it, as after an operator restart."""

from __future__ import annotations

from argosy_operator.autoscaling import AutoscalingPolicy, MetricsSample, ReplicaSample
from argosy_operator.autoscaling.autoscaler import Autoscaler

IDLE = ReplicaSample(kv_cache_usage=0.0, num_waiting=0.0, num_running=0.0)
AT_TARGET = ReplicaSample(kv_cache_usage=0.3, num_waiting=4.0, num_running=4.0)  # queue target 4


def tick(autoscaler: Autoscaler, t: float, current: int, replica: ReplicaSample) -> int:
    autoscaler.observe(MetricsSample(t=t, replicas=(replica,) * current))
    return autoscaler.decide(current, now=t).desired_replicas


def test_a_gap_in_the_samples_is_not_idle_time() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4,
                               scale_to_zero_idle_seconds=600)
    autoscaler = Autoscaler(policy)
    for t in range(0, 305, 5):  # 300 s measured idle
        assert tick(autoscaler, float(t), 1, IDLE) == 1
    # Nothing seen from 300 s to 900 s (the replica may have served all along), then one idle
    # sample: 600 s since the idle stretch began, but only its first 300 s were observed.
    assert tick(autoscaler, 900.0, 1, IDLE) == 1
    # Idle from then on: zero once a whole scaleToZeroIdleSeconds has been observed idle.
    desired = {float(t): tick(autoscaler, float(t), 1, IDLE) for t in range(905, 1600, 5)}
    zero_at = min(t for t, d in desired.items() if d == 0)
    assert 900.0 + 600 <= zero_at <= 900.0 + 605


def test_a_gap_in_the_samples_restarts_the_scale_down_window() -> None:
    policy = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=8)
    autoscaler = Autoscaler(policy)
    for t in range(0, 605, 5):  # watched for 600 s: 8 replicas, each at target
        assert tick(autoscaler, float(t), 8, AT_TARGET) == 8
    # Blind for 10 minutes (longer than scaleDownStabilizationSeconds, so no recommendation
    # from before is left), then a lull: one low sample is no window of lower demand.
    assert tick(autoscaler, 1200.0, 8, IDLE) == 8
    desired = {float(t): tick(autoscaler, float(t), 8, IDLE) for t in range(1205, 1600, 5)}
    down_at = min(t for t, d in desired.items() if d < 8)
    assert down_at >= 1200.0 + policy.scale_down_stabilization_seconds
