"""Pod and container security contexts: non-root, read-only root, no privilege escalation."""

from __future__ import annotations

from typing import Any

from argosy_operator.constants import RUN_AS_USER


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        # Volumes (the model emptyDir, PVCs) group-owned by the runtime's group.
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
