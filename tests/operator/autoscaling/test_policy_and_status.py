"""Policy parsing/validation, the metrics window, and the status/conditions the timer writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from argosy_operator.autoscaling import (
    AutoscalingPolicy,
    DecisionState,
    MetricsSample,
    MetricsWindow,
    ReplicaSample,
    decide,
)
from argosy_operator.autoscaling.status import autoscaling_status, scaling_conditions
from argosy_operator.spec import DEFAULTS

CRD = Path(__file__).resolve().parents[3] / "crds" / "llmdeployments.argosy.dev.yaml"

# The contract (issue 8), field by field.
CONTRACT = {
    "enabled": False, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUtilization": 0.7,
    "targetQueueDepth": 4, "tolerance": 0.1, "stableWindowSeconds": 60,
    "panicWindowSeconds": 6, "panicThreshold": 2.0, "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 300, "maxScaleUpRate": 2.0, "maxScaleDownRate": 0.5,
    "scrapeIntervalSeconds": 5, "scaleToZeroIdleSeconds": 600,
}


def test_defaults_match_the_contract_and_the_operator_spec() -> None:
    assert AutoscalingPolicy.from_spec({}) == AutoscalingPolicy.from_spec(CONTRACT)
    assert AutoscalingPolicy().to_spec() == {k: v for k, v in CONTRACT.items()}
    assert AutoscalingPolicy.from_spec(DEFAULTS["autoscaling"]) == AutoscalingPolicy()


@pytest.mark.skipif(not CRD.exists(), reason="the CRD (issue 7) is not written yet")
def test_defaults_match_the_crd() -> None:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "autoscaling"]["properties"]
    crd_defaults = {k: p["default"] for k, p in props.items() if "default" in p}
    assert crd_defaults == CONTRACT
    status_props = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"desiredReplicas", "lastScaleTime", "kvCacheUtilization", "kvCachePercent",
            "queueDepth", "autoscaling", "conditions"} <= set(status_props)


@pytest.mark.parametrize(("spec", "field"), [
    ({"minReplicas": 5, "maxReplicas": 2}, "minReplicas"),
    ({"maxReplicas": 0}, "maxReplicas"),
    ({"minReplicas": -1}, "minReplicas"),
    ({"minReplicas": 1.5}, "minReplicas"),
    ({"targetKVCacheUtilization": 0}, "targetKVCacheUtilization"),
    ({"targetKVCacheUtilization": 1.2}, "targetKVCacheUtilization"),
    ({"targetQueueDepth": 0}, "targetQueueDepth"),
    ({"tolerance": 1}, "tolerance"),
    ({"panicWindowSeconds": 120}, "panicWindowSeconds"),
    ({"panicThreshold": 0.9}, "panicThreshold"),
    ({"maxScaleUpRate": 0.5}, "maxScaleUpRate"),
    ({"maxScaleDownRate": 1.5}, "maxScaleDownRate"),
    ({"scrapeIntervalSeconds": 0}, "scrapeIntervalSeconds"),
    ({"scaleDownStabilizationSeconds": -5}, "scaleDownStabilizationSeconds"),
    ({"enabled": "yes"}, "enabled"),
    ({"stableWindowSeconds": "60s"}, "stableWindowSeconds"),
    ({"targetKvCacheUtilization": 0.5}, "targetKvCacheUtilization"),  # typo: unknown field
])
def test_invalid_policies_name_the_field(spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"spec.autoscaling.{field}"):
        AutoscalingPolicy.from_spec(spec)


def test_rates_of_one_still_move_one_replica() -> None:
    policy = AutoscalingPolicy(enabled=True, max_replicas=10, max_scale_up_rate=1.0,
                               panic_threshold=1.0)
    d = decide(policy, 2, [_sample(0.0, 40.0)], DecisionState(), now=0.0)
    assert d.desired_replicas == 3 and d.limit_reason == "ScaleUpRate"


def test_metrics_window_is_bounded_and_ordered() -> None:
    window = MetricsWindow(keep_seconds=10, max_samples=5)
    for t in range(0, 30, 2):
        window.add(MetricsSample(t=float(t), replicas=()))
    assert [s.t for s in window.samples()] == [20.0, 22.0, 24.0, 26.0, 28.0]
    window = MetricsWindow(keep_seconds=5)
    for t in range(0, 30, 2):
        window.add(MetricsSample(t=float(t), replicas=()))
    assert [s.t for s in window.samples()] == [24.0, 26.0, 28.0]
    with pytest.raises(ValueError, match="older"):
        window.add(MetricsSample(t=1.0, replicas=()))


def _sample(t: float, waiting: float, n: int = 2) -> MetricsSample:
    return MetricsSample(t=t, replicas=tuple(
        ReplicaSample(kv_cache_usage=0.35, num_waiting=waiting, num_running=2.0)
        for _ in range(n)))


def test_status_and_conditions_from_a_decision() -> None:
    policy = AutoscalingPolicy(enabled=True, max_replicas=3)
    d = decide(policy, 2, [_sample(0.0, 40.0)], DecisionState(), now=0.0)
    st = autoscaling_status(d, last_scale_time=1_767_225_600.0)  # 2026-01-01T00:00:00Z
    assert st["desiredReplicas"] == 3 and d.reason == "PanicScaleUp"
    assert st["lastScaleTime"] == "2026-01-01T00:00:00Z"
    assert st["kvCacheUtilization"] == 0.35 and st["kvCachePercent"] == 35
    assert st["queueDepth"] == 40.0
    assert st["autoscaling"]["panic"] is True and st["autoscaling"]["limitedBy"] == "MaxReplicas"
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["ScalingActive"]["status"] == "True"
    assert (conds["ScalingLimited"]["status"], conds["ScalingLimited"]["reason"]) == \
        ("True", "TooManyReplicas")
    # No metrics at all: ScalingActive False, no lastScaleTime, and the readings null (a
    # merge patch deletes them: an old reading must not pass for the current one).
    blind = MetricsSample(t=0.0, replicas=(ReplicaSample(ready=False),))
    d = decide(policy, 2, [blind], DecisionState(), now=0.0)
    st = autoscaling_status(d, last_scale_time=None)
    assert "lastScaleTime" not in st
    assert st["kvCacheUtilization"] is st["kvCachePercent"] is st["queueDepth"] is None
    assert scaling_conditions(d)[0]["status"] == "False"
    assert scaling_conditions(d)[0]["reason"] == "FailedGetMetrics"
    # An unchanged decision builds an identical status (so nothing is re-written).
    d2 = dataclasses.replace(d)
    assert autoscaling_status(d2, None) == st


@pytest.mark.skipif(not CRD.exists(), reason="the CRD (issue 7) is not written yet")
def test_status_validates_against_the_crd_schema() -> None:
    import jsonschema
    from argosy_operator.conditions import merge_conditions

    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    policy = AutoscalingPolicy(enabled=True, max_replicas=3)
    for samples, current in (([_sample(0.0, 40.0)], 2), ([_sample(0.0, 4.0)], 2),
                             ([MetricsSample(t=0.0, replicas=(ReplicaSample(ready=False),))], 1)):
        d = decide(policy, current, samples, DecisionState(), now=0.0)
        st = autoscaling_status(d, last_scale_time=1_767_225_600.0)
        st["conditions"] = merge_conditions([], st["conditions"], "2026-01-01T00:00:00Z")
        # What the API server stores from the merge patch: a null deletes its key.
        jsonschema.validate({k: v for k, v in st.items() if v is not None}, schema)


@pytest.mark.skipif(not CRD.exists(), reason="the CRD (issue 7) is not written yet")
def test_every_crd_valid_policy_is_accepted() -> None:
    import jsonschema
    from hypothesis import given, settings
    from hypothesis import strategies as st

    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "autoscaling"]
    schema = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes")}
    ints = st.integers(-2, 700)
    nums = st.floats(-0.5, 3.0, allow_nan=False)
    kinds = {k: (ints if p["type"] == "integer" else st.booleans() if p["type"] == "boolean"
                 else nums) for k, p in schema["properties"].items()}

    @settings(max_examples=150, deadline=None)
    @given(st.fixed_dictionaries({}, optional=kinds))
    def check(spec: dict) -> None:
        merged = {**CONTRACT, **spec}
        try:
            jsonschema.validate(merged, schema, cls=jsonschema.Draft4Validator)
        except jsonschema.ValidationError:
            return
        if merged["minReplicas"] > merged["maxReplicas"]:
            return  # the CRD's CEL rule rejects it
        if merged["panicWindowSeconds"] > merged["stableWindowSeconds"]:
            with pytest.raises(ValueError, match="panicWindowSeconds"):
                AutoscalingPolicy.from_spec(spec)
            return
        AutoscalingPolicy.from_spec(spec)

    check()
