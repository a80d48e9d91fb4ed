"""The Service in front of the runtime pods (OpenAI API and /metrics on one port)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.common import child_metadata, selector_labels
from argosy_operator.constants import RUNTIME_PORT_NAME


def build_service(llmd: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    service = spec["service"]
    name = llmd["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(llmd, annotations=service.get("annotations")),
        "spec": {
            "type": service["type"],
            "selector": selector_labels(name),
            "ports": [{"name": RUNTIME_PORT_NAME, "port": int(service["port"]),
                       "targetPort": RUNTIME_PORT_NAME, "protocol": "TCP"}],
        },
    }
