"""Replay a recorded metrics trace through the decision function (`argosy autoscale-sim`).

Trace: JSON lines `{"t": seconds, "replicas": [{"kv": 0.4, "waiting": 2, "running": 5,
"batch": 0, "finished": 17, "name": "pod-a", "ready": true}, ...]}` (optional: `batch`, Batch
API requests pending; `finished` and `name`, requests finished so far and whose, for
idleness between lines); the replicas listed are those that existed at `t` (the trace is
recorded traffic, so the simulator's decisions do not change it); a failed scrape has `null`
metrics, an unready replica `"ready": false`. One decision per line, in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from argosy_operator.autoscaling.autoscaler import Autoscaler
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample


def policy_from_document(doc: Any) -> AutoscalingPolicy:
    """Accept a whole LLMDeployment manifest, `{autoscaling: {...}}`, or the bare mapping.

    The simulator evaluates the policy whether or not `enabled` is set: tuning happens before
    enabling it.
    """
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ValueError(f"policy: must be a mapping, got {type(doc).__name__}")
    if "spec" in doc:
        spec = doc["spec"]
        if not isinstance(spec, Mapping):
            raise ValueError("policy: spec must be a mapping")
        doc = spec.get("autoscaling") or {}
    elif "autoscaling" in doc:
        doc = doc["autoscaling"] or {}
    return AutoscalingPolicy.from_spec(doc)


def load_policy(path: str | Path) -> AutoscalingPolicy:
    with open(path, encoding="utf-8") as f:
        return policy_from_document(yaml.safe_load(f))


def read_trace(lines: Iterable[str]) -> Iterator[MetricsSample]:
    """Parse JSON lines (blank lines skipped); errors name the line number."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield MetricsSample.from_trace(json.loads(line))
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"trace line {lineno}: {exc}") from exc


def simulate(policy: AutoscalingPolicy, trace: Iterable[MetricsSample],
             verbose: bool = False) -> Iterator[dict[str, Any]]:
    """One `{"t", "current", "desired", "reason"}` record per trace sample (more with verbose)."""
    autoscaler = Autoscaler(policy)
    for sample in trace:
        autoscaler.observe(sample)
        decision = autoscaler.decide(len(sample.replicas), now=sample.t)
        record: dict[str, Any] = {
            "t": sample.t,
            "current": decision.current_replicas,
            "desired": decision.desired_replicas,
            "reason": decision.reason,
        }
        if verbose:
            m = decision.metrics
            record.update(
                panic=decision.panic,
                limited=decision.limit_reason,
                kv=None if m.kv_cache_utilization is None else round(m.kv_cache_utilization, 4),
                queue=None if m.queue_depth is None else round(m.queue_depth, 4),
                demand=None if m.demand is None else round(m.demand, 4),
                batch_replicas=m.batch_replicas,
                message=decision.message,
            )
        yield record
