"""The Prometheus Operator ServiceMonitor that scrapes the runtime's /metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.common import child_metadata, selector_labels
from argosy_operator.constants import RUNTIME_PORT_NAME


def build_servicemonitor(llmd: Mapping[str, Any], spec: Mapping[str, Any]
                         ) -> dict[str, Any] | None:
    """None when spec.monitoring.serviceMonitor is false (the reconciler also skips it when
    the ServiceMonitor CRD is not installed)."""
    monitoring = spec["monitoring"]
    if not monitoring["serviceMonitor"]:
        return None
    metadata = child_metadata(llmd)
    # The operator's labels win: the Service selector and ownership checks rely on them.
    metadata["labels"] = {**monitoring.get("labels", {}), **metadata["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(llmd["metadata"]["name"])},
            "endpoints": [{"port": RUNTIME_PORT_NAME, "path": "/metrics",
                           "interval": monitoring["interval"]}],
        },
    }
