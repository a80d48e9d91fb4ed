"""The gateway's HTTP side: an aiohttp app that proxies OpenAI requests to replicas."""

from __future__ import annotations

from argosy_runtime.gateway.proxy.app import Gateway, run_gateway, start_gateway

__all__ = ["Gateway", "run_gateway", "start_gateway"]
