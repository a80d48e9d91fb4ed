"""`argosy autoscale-sim` on trace files: the decision-function scenarios, end to end.

A trace is recorded traffic: the replica count in each line is what existed, whatever the
simulator recommends, so these check the recommendations (`desired`) against `current`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from argosy_runtime.cli.main import main

DT = 5.0
Replica = dict[str, Any]


def at_load(waiting: float, kv: float = 0.2, running: float = 3.0) -> Replica:
    return {"kv": kv, "waiting": waiting, "running": running, "ready": True}


def write_trace(path: Path, duration: float, replicas_at: Callable[[float], list[Replica]]) -> Path:
    lines = []
    t = 0.0
    while t <= duration:
        lines.append(json.dumps({"t": t, "replicas": replicas_at(t)}))
        t += DT
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    # A whole LLMDeployment manifest works as the policy file; defaults fill the rest.
    path = tmp_path / "policy.yaml"
    path.write_text("apiVersion: argosy.dev/v1alpha1\nkind: LLMDeployment\n"
                    "metadata: {name: chat}\n"
                    "spec:\n  autoscaling:\n    enabled: true\n    maxReplicas: 10\n")
    return path


def sim(capsys: pytest.CaptureFixture[str], policy: Path, trace: Path,
        *extra: str) -> list[dict[str, Any]]:
    code = main(["autoscale-sim", "--policy", str(policy), "--trace", str(trace), *extra])
    out = capsys.readouterr().out
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


def test_steady_load_never_changes(tmp_path: Path, policy: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    # 3 replicas at 3.8..4.2 waiting each (target 4, tolerance 10%).
    trace = write_trace(tmp_path / "t.jsonl", 1800, lambda t: [
        at_load(4.0 + 0.2 * ((int(t / DT) + i) % 3 - 1)) for i in range(3)])
    out = sim(capsys, policy, trace)
    assert len(out) == 1800 / DT + 1
    assert set(out[0]) == {"t", "current", "desired", "reason"}
    assert all(r["desired"] == r["current"] == 3 for r in out)


def test_sustained_queue_scales_up_within_stable_window(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    onset = 300.0
    trace = write_trace(tmp_path / "t.jsonl", 600, lambda t: [
        at_load(4.0 if t < onset else 6.4) for _ in range(2)])  # 1.6x: below panic
    out = sim(capsys, policy, trace)
    first_up = next(r for r in out if r["desired"] > r["current"])
    assert onset < first_up["t"] <= onset + 60 and first_up["reason"] == "ScaleUp"
    assert all(r["desired"] == 2 for r in out if r["t"] < onset)


def test_spike_panics_at_once(tmp_path: Path, policy: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    onset = 300.0
    trace = write_trace(tmp_path / "t.jsonl", 400, lambda t: [
        at_load(4.0 if t < onset else 20.0) for _ in range(2)])
    out = sim(capsys, policy, trace)
    spike = next(r for r in out if r["t"] == onset)
    assert spike["reason"] == "PanicScaleUp" and spike["desired"] == 4  # x2 at most


def test_drop_scales_down_only_after_stabilization(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    drop = 300.0
    trace = write_trace(tmp_path / "t.jsonl", 1000, lambda t: [
        at_load(4.0 if t < drop else 0.5) for _ in range(4)])
    out = sim(capsys, policy, trace)
    first_down = next(r for r in out if r["desired"] < r["current"])
    assert drop + 300 <= first_down["t"] <= drop + 300 + 60
    assert first_down["reason"] == "ScaleDown" and first_down["desired"] >= 2
    assert any(r["reason"] == "ScaleDownStabilizing" for r in out if r["t"] < first_down["t"])


def test_oscillating_load_never_recommends_a_scale_down(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", 3600, lambda t: [
        at_load(6.0 if (t // 60) % 2 == 0 else 1.6) for _ in range(2)])
    out = sim(capsys, policy, trace)
    assert any(r["desired"] > r["current"] for r in out)
    assert not any(r["desired"] < r["current"] for r in out)


@pytest.mark.parametrize("broken", [
    {"kv": None, "waiting": None, "running": None, "ready": True},  # scrape failed
    {"kv": None, "waiting": None, "running": None, "ready": False},  # not ready
])
def test_failed_and_unready_replicas_never_cause_scale_down(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str],
        broken: Replica) -> None:
    # 2 healthy replicas exactly at target, 2 broken ones, for 30 minutes.
    trace = write_trace(tmp_path / "t.jsonl", 1800, lambda t: [
        at_load(4.0), at_load(4.0), dict(broken), dict(broken)])
    out = sim(capsys, policy, trace)
    assert all(r["desired"] >= r["current"] == 4 for r in out)
    # All broken: no metrics, no change.
    trace = write_trace(tmp_path / "t2.jsonl", 600, lambda t: [dict(broken)] * 3)
    out = sim(capsys, policy, trace)
    assert {(r["desired"], r["reason"]) for r in out} == {(3, "NoMetrics")}


def test_min_max_respected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("minReplicas: 2\nmaxReplicas: 3\n")  # bare spec.autoscaling mapping
    trace = write_trace(tmp_path / "t.jsonl", 1200, lambda t: [
        at_load(100.0 if t < 300 else 0.0, running=0.0 if t >= 300 else 5.0)
        for _ in range(3 if t < 600 else 1)])
    out = sim(capsys, policy, trace, "--verbose")
    assert all(2 <= r["desired"] <= 3 for r in out)
    assert any(r["reason"] == "AtMaxReplicas" for r in out)
    assert any(r["reason"] == "BelowMinReplicas" for r in out)  # the trace dropped to 1
    assert {"panic", "kv", "queue", "demand", "message"} <= set(out[0])


def test_trace_batch_counts_hold_the_replicas_that_run_them(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Six idle replicas for 20 minutes, four of them with Batch API requests pending: the
    # rate limit alone would allow 6 -> 3.
    idle = at_load(0.0, kv=0.0, running=0.0)
    trace = write_trace(tmp_path / "t.jsonl", 1200, lambda t: [
        *[{**idle, "batch": 30}] * 4, idle, idle])
    out = sim(capsys, policy, trace, "--verbose")
    assert min(r["desired"] for r in out) == 4
    assert out[-1]["reason"] == "ScaleDown" and out[-1]["batch_replicas"] == 4
    assert out[-1]["limited"] == "BatchRequests"
    # The same replicas sharing one batch folder: only the rate limit holds them (6 -> 3).
    shared = tmp_path / "shared.jsonl"
    shared.write_text("".join(json.dumps({**json.loads(line), "batches_shared": True}) + "\n"
                              for line in trace.read_text().splitlines()))
    out = sim(capsys, policy, shared, "--verbose")
    assert min(r["desired"] for r in out) == 3 and out[-1]["limited"] == "ScaleDownRate"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"t": 0, "replicas": [{"kv": 0, "waiting": 0, "batch": -1}]}\n')
    assert main(["autoscale-sim", "--policy", str(policy), "--trace", str(broken)]) == 2
    assert "batch_pending" in capsys.readouterr().err


def test_invalid_inputs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_policy = tmp_path / "bad.yaml"
    bad_policy.write_text("autoscaling: {targetKVCacheUtilization: 1.5}\n")
    trace = write_trace(tmp_path / "t.jsonl", 10, lambda t: [at_load(1.0)])
    assert main(["autoscale-sim", "--policy", str(bad_policy), "--trace", str(trace)]) == 2
    assert "targetKVCacheUtilization" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("{}\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"t": 0, "replicas": []}\n{"t": 5, "replicas": [{"kv": "high"}]}\n')
    assert main(["autoscale-sim", "--policy", str(good), "--trace", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "replica.kv" in err


def test_cli_entry_point_runs_without_torch(tmp_path: Path, policy: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", 20, lambda t: [at_load(4.0)] * 2)
    code = ("import sys, json\n"
            "from argosy_runtime.cli.main import main\n"
            f"rc = main(['autoscale-sim', '--policy', {str(policy)!r}, '--trace', {str(trace)!r}])\n"
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == {"rc": 0, "torch": False}
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [r["t"] for r in lines] == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert all(r["desired"] == 2 for r in lines)


def test_held_requests_in_a_trace_wake_a_deployment_at_zero(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("minReplicas: 0\nmaxReplicas: 3\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "replicas": []}\n{"t": 5, "replicas": [], "held": 2}\n')
    out = sim(capsys, policy, trace)
    assert [(r["desired"], r["reason"]) for r in out] == [(0, "ScaledToZero"),
                                                         (1, "ScaleFromZero")]
    for bad, field in (('{"t": 0, "replicas": [], "held": -1}', "held"),
                       ('{"t": 0, "replicas": [], "helf": 1}', "unknown keys"),
                       ('{"t": 0, "replicas": [], "batches_shared": "yes"}', "batches_shared")):
        trace.write_text(bad + "\n")
        assert main(["autoscale-sim", "--policy", str(policy), "--trace", str(trace)]) == 2
        assert field in capsys.readouterr().err
