"""Autoscaling of LLMDeployments on KV-cache utilization and queue depth.

The pure core (`policy`, `samples`, `decision`, `metrics_window`, `simulator`) has no Kubernetes
types and no I/O, so `argosy autoscale-sim` and `argosy fleet` reuse it; `scraper` reads
replicas' Prometheus metrics and `timer` is the kopf timer that applies decisions in a cluster.
Importing this package imports neither kopf nor torch.
"""

from __future__ import annotations

from argosy_operator.autoscaling.decision import Decision, DecisionMetrics, DecisionState, decide
from argosy_operator.autoscaling.metrics_window import MetricsWindow
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample, ReplicaSample

__all__ = [
    "AutoscalingPolicy",
    "Decision",
    "DecisionMetrics",
    "DecisionState",
    "MetricsSample",
    "MetricsWindow",
    "ReplicaSample",
    "decide",
]
