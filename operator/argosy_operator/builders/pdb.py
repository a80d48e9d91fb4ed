"""The PodDisruptionBudget: voluntary evictions (node drains) take one replica at a time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.common import child_metadata, selector_labels
from argosy_operator.spec import max_replicas


def build_pdb(llmd: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """None when the spec can never run more than one replica: a budget over a single pod
    would block node drains forever (maxUnavailable 0) or protect nothing (1)."""
    if max_replicas(spec) <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(llmd),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(llmd["metadata"]["name"])},
            # Pods that never became ready (e.g. crash-looping) may be evicted regardless.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
