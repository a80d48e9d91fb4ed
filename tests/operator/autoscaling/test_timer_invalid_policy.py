"""An autoscaling policy that the CRD admits but the autoscaler cannot run (the real kopf
operator against the emulated API)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from crd_schema import validate
from operator_helpers import Api, wait_for_degraded
from test_timer_kmock import EVENT_PATH, FAST, LLMD_PATH, llmd

pytestmark = pytest.mark.timeout(150)


async def test_a_panic_window_longer_than_the_stable_window_is_reported_once(
        kube: Any, api: Api, run_operator: Any, caplog: pytest.LogCaptureFixture) -> None:
    """panicWindowSeconds > stableWindowSeconds passed the CRD before its rule, but the
    autoscaler refuses it: the owner says so (Degraded InvalidSpec, naming the field) rather
    than looking healthy while nothing scales, and the timer, which ticks every second, logs
    the error once rather than every tick."""
    kube.crd_validation = False  # admitted under a CRD without the rule (test below)
    policy = {**FAST, "stableWindowSeconds": 3, "panicWindowSeconds": 10}
    with run_operator():
        await api.call("POST", LLMD_PATH, llmd("llm", policy), "application/json")
        cond = await wait_for_degraded(api, "InvalidSpec", "llm")
        assert "panicWindowSeconds" in cond["message"], cond
        await asyncio.sleep(4)  # four ticks of the timer
    logged = [r.getMessage() for r in caplog.records if "invalid policy" in r.getMessage()]
    assert len(logged) == 1, logged
    warnings = [r.data for r in list(kube)
                if r.method == "POST" and EVENT_PATH in str(r.url) and isinstance(r.data, dict)
                and r.data.get("type") != "Normal"]
    assert [w["reason"] for w in warnings] == ["InvalidSpec"]


def test_the_crd_refuses_a_panic_window_longer_than_the_stable_window() -> None:
    obj = llmd("llm", {**FAST, "stableWindowSeconds": 3, "panicWindowSeconds": 10})
    _, errors = validate(obj)
    assert any("panicWindowSeconds must be <= autoscaling.stableWindowSeconds" in e
               for e in errors), errors
    obj["spec"]["autoscaling"]["enabled"] = False  # a policy not in use is not checked
    assert validate(obj)[1] == []
    assert validate(llmd("llm", FAST))[1] == []
