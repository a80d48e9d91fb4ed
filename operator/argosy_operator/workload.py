"""Read and scale the Deployment behind an LLMDeployment (shared with the autoscaler).

The Deployment has the LLMDeployment's name and namespace. The autoscaler owns
`spec.replicas` when spec.autoscaling.enabled is true; the reconciler then never writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.common import selector_string
from argosy_operator.kube import DEPLOYMENTS, PODS, KubeClient


async def get_deployment(client: KubeClient, namespace: str, name: str
                         ) -> dict[str, Any] | None:
    """The LLMDeployment's Deployment, or None when it does not exist (yet)."""
    return await client.get(DEPLOYMENTS, namespace, name)


async def list_pods(client: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    """The runtime pods of an LLMDeployment (by the selector label)."""
    return await client.list(PODS, namespace, label_selector=selector_string(name))


def deployment_replicas(deployment: Mapping[str, Any] | None) -> int | None:
    """spec.replicas of a Deployment (1 when unset: the API server's default)."""
    if deployment is None:
        return None
    return int((deployment.get("spec") or {}).get("replicas", 1))


async def scale_deployment(client: KubeClient, namespace: str, name: str, replicas: int,
                           *, resource_version: str | None = None) -> dict[str, Any]:
    """Set spec.replicas of the LLMDeployment's Deployment (a merge patch of that one field);
    with `resource_version`, only if the Deployment is still at it (ApiError 409 otherwise)."""
    if replicas < 0:
        raise ValueError(f"replicas: must be >= 0, got {replicas}")
    patch: dict[str, Any] = {"spec": {"replicas": int(replicas)}}
    if resource_version:
        patch["metadata"] = {"resourceVersion": resource_version}
    return await client.patch(DEPLOYMENTS, namespace, name, patch)
