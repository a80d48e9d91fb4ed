"""Replicas of an LLMDeployment, discovered from its Pods or EndpointSlices (list + watch).

The watch stream delivers every change (a pod becoming Ready, a pod deleted on scale-down)
within moments, and the pool's membership follows; a quiet stream is ended by the server
after `resync_s` and the list is read again, so a missed event cannot stick. Only ready
endpoints are used: a pod that is starting, draining (its readiness probe fails on /ready) or
terminating gets no traffic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import aiohttp

from argosy_runtime.background_tasks import cancel_and_wait
from argosy_runtime.gateway.backends.kube_api import KubeAPI, resolve
from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.config import KubernetesBackendConfig

logger = logging.getLogger(__name__)

_SET_RE = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def matches_selector(labels: dict[str, str], selector: str) -> bool:
    """Kubernetes label-selector semantics (=, ==, !=, in, notin, exists, !exists).

    The API server filters with the same selector; checking again here keeps discovery
    correct against servers or proxies that ignore `labelSelector`.
    """
    for term in _split_selector(selector):
        m = _SET_RE.match(term)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            inside = key in labels and labels[key] in values
            if inside != (op == "in"):
                return False
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


class KubernetesDiscovery:
    """Keeps `pool` equal to the ready endpoints of one LLMDeployment."""

    def __init__(
        self,
        pool: ReplicaPool,
        config: KubernetesBackendConfig,
        session: aiohttp.ClientSession,
        api: KubeAPI | None = None,
    ) -> None:
        self.pool = pool
        self.config = config
        self._session = session
        self._api = api
        self._objects: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()  # set after the first successful list

    @property
    def selector(self) -> str:
        c = self.config
        if c.source == "endpointslices" and not c.label_selector:
            # The operator's Service for an LLMDeployment carries the deployment's name.
            return f"kubernetes.io/service-name={c.llmdeployment}"
        return c.selector

    @property
    def path(self) -> str:
        ns = self.config.namespace
        if self.config.source == "endpointslices":
            return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        return f"/api/v1/namespaces/{ns}/pods"

    def urls_of(self, obj: dict[str, Any]) -> list[str]:
        """Ready replica URLs in one Pod or EndpointSlice."""
        if not matches_selector(obj.get("metadata", {}).get("labels") or {}, self.selector):
            return []
        if self.config.source == "endpointslices":
            return self._slice_urls(obj)
        return self._pod_urls(obj)

    def _pod_urls(self, pod: dict[str, Any]) -> list[str]:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            return []
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ready or not ip:
            return []
        port = self.config.port
        for container in (pod.get("spec") or {}).get("containers") or []:
            for p in container.get("ports") or []:
                if p.get("name") == self.config.port_name and p.get("containerPort"):
                    port = int(p["containerPort"])
        return [_url(ip, port)]

    def _slice_urls(self, eps: dict[str, Any]) -> list[str]:
        ports = eps.get("ports") or []
        port = next(
            (p.get("port") for p in ports if p.get("name") == self.config.port_name), None
        ) or (ports[0].get("port") if ports else None) or self.config.port
        urls = []
        for endpoint in eps.get("endpoints") or []:
            cond = endpoint.get("conditions") or {}
            # `ready` unset means unknown, which Kubernetes says to treat as ready.
            if cond.get("ready") is False or cond.get("terminating"):
                continue
            urls.extend(_url(a, int(port)) for a in endpoint.get("addresses") or [])
        return urls

    def _apply(self) -> None:
        urls = sorted({u for obj in self._objects.values() for u in self.urls_of(obj)})
        if self.pool.set_urls(urls):
            logger.info("model %s: replicas now %s", self.pool.model, urls)

    async def _list(self, api: KubeAPI) -> str:
        params = {"labelSelector": self.selector}
        async with self._session.get(
            api.base_url + self.path, params=params, headers=api.headers, ssl=api.ssl_context
        ) as resp:
            resp.raise_for_status()
            data = await resp.json(content_type=None)
        self._objects = {
            o["metadata"]["name"]: o for o in data.get("items") or [] if "metadata" in o
        }
        self._apply()
        self.synced.set()
        return str((data.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, api: KubeAPI, resource_version: str) -> None:
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(self.config.resync_s)),
        }
        if resource_version and resource_version.isdigit():
            params["resourceVersion"] = resource_version
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.config.resync_s + 30)
        async with self._session.get(
            api.base_url + self.path,
            params=params,
            headers=api.headers,
            ssl=api.ssl_context,
            timeout=timeout,
        ) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                    return
                name = (obj.get("metadata") or {}).get("name")
                if kind == "BOOKMARK" or not name:
                    continue
                if kind == "DELETED":
                    self._objects.pop(name, None)
                else:
                    self._objects[name] = obj
                self._apply()

    async def run(self) -> None:
        """List, then watch; on any end or error, list again (with backoff on errors)."""
        backoff = 0.5
        while True:
            try:
                api = self._api or resolve(self.config.api_url)
                self._api = api
                rv = await self._list(api)
                await self._watch(api, rv)
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API down, auth, bad JSON: keep the last membership
                logger.warning("discovery for %s failed: %r", self.pool.model, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"
