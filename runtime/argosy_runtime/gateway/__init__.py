"""Argosy gateway: one OpenAI-compatible address in front of many runtime replicas.

It decides, per request, which model answers (the cascade) and which replica serves it (the
routing policy), streams the answer back chunk by chunk, and keeps unhealthy replicas out of
rotation. It never imports torch: its dependencies are aiohttp, pyyaml and prometheus-client.
"""

from __future__ import annotations

from argosy_runtime.gateway.config import (
    CascadeConfig,
    GatewayConfig,
    HealthConfig,
    KubernetesBackendConfig,
    ModelRouteConfig,
    RoutingConfig,
    TenantConfig,
    load_config,
)

__all__ = [
    "CascadeConfig",
    "GatewayConfig",
    "HealthConfig",
    "KubernetesBackendConfig",
    "ModelRouteConfig",
    "RoutingConfig",
    "TenantConfig",
    "load_config",
]
