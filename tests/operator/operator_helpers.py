"""Helpers for the operator tests (the fixtures are in conftest.py): the test namespace, a
small HTTP client for the test's own writes, polling, and the API calls the operator made."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from kube_emulator import ArgosyKubeEmulator

NS = "ml"


class Api:
    """The test's own API calls (as kubectl or the kube controllers would make them)."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base.rstrip("/")

    async def call(self, method: str, path: str, body: Any = None,
                   content_type: str = "application/merge-patch+json") -> Any:
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self.session.request(method, self.base + path, json=body,
                                        headers=headers) as resp:
            payload = await resp.json() if resp.content_length != 0 else None
            assert resp.status < 400, (method, path, resp.status, payload)
            return payload

    async def get_or_none(self, path: str) -> Any:
        async with self.session.get(self.base + path) as resp:
            return None if resp.status == 404 else await resp.json()


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 15.0,
                     what: str = "condition") -> Any:
    """Poll `check` until it returns a truthy value (returned) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


async def wait_for_degraded(api: Api, reason: str, name: str = "chat") -> dict[str, Any]:
    """The Degraded condition of LLMDeployment `name` (in NS) once its reason is `reason`."""
    path = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments/{name}"

    async def degraded() -> dict[str, Any] | None:
        status = (await api.get_or_none(path) or {}).get("status", {})
        cond = next((c for c in status.get("conditions", []) if c["type"] == "Degraded"), {})
        return cond if cond.get("reason") == reason else None

    return await eventually(degraded, what=f"Degraded={reason}")


async def settle(kube: ArgosyKubeEmulator, quiet: float = 1.0, timeout: float = 20.0) -> None:
    """Wait until the API has seen no request for `quiet` seconds (the operator went idle)."""
    deadline = time.monotonic() + timeout
    count = len(list(kube))
    since = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = len(list(kube))
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
    raise AssertionError("the operator never went idle")


def granted_calls(cluster_role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every rule of a ClusterRole."""
    return {(group, resource, verb) for rule in cluster_role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def _verb(request: Any) -> str:
    if request.method == "GET":
        if request.params.get("watch") == "true":
            return "watch"
        return "get" if request.name else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[
        request.method]


def operator_calls(kube: ArgosyKubeEmulator) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of every request kopf or the operator's own
    client sent to the emulated API server (discovery excluded: every user may read it)."""
    made = set()
    for request in list(kube):
        agent = request.headers.get("User-Agent", "")
        if request.resource is None or request.resource.plural is None:
            continue
        if agent.startswith(("kopf/", "argosy-operator/")):
            resource = request.resource.plural + (
                f"/{request.subresource}" if request.subresource else "")
            made.add((request.resource.group, resource, _verb(request)))
    return made
