"""A small asyncio Kubernetes API client on aiohttp, with kopf's credentials.

The operator needs a handful of verbs on a handful of resources; a generated client would
triple the image. Every call goes through `KubeClient.request`, which names the RBAC verb it
needs (the manifests' ClusterRole is tested against the calls the operator makes).
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Resource:
    """A resource type: `Resource("apps", "v1", "deployments")`; group "" is the core API."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def discovery_path(self) -> str:
        """The group-version's discovery document, which lists the resources served there."""
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        parts = [self.discovery_path]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
            if subresource:
                parts.append(subresource)
        return "/".join(parts)


DEPLOYMENTS = Resource("apps", "v1", "deployments")
SERVICES = Resource("", "v1", "services")
PODS = Resource("", "v1", "pods")
CONFIGMAPS = Resource("", "v1", "configmaps")
PDBS = Resource("policy", "v1", "poddisruptionbudgets")
SERVICEMONITORS = Resource("monitoring.coreos.com", "v1", "servicemonitors")
LLMDEPLOYMENTS = Resource("argosy.dev", "v1alpha1", "llmdeployments")

USER_AGENT = "argosy-operator/0.1.0"

# Seconds a discovery answer (one group-version document) is reused. Every reconcile asks
# whether the ServiceMonitor API is served; uncached, a burst of reconciles (a restart resumes
# every LLMDeployment) would send the API server one discovery GET each. Short, because a
# reconcile acts on a stale answer until it expires; the handlers that watch for the CRD to
# appear ask with `fresh=True` and so are never delayed by it.
DISCOVERY_CACHE_SECONDS = 30.0


class ApiError(Exception):
    """A non-2xx answer, or a 2xx whose body is not JSON: `status` (HTTP code), `reason`
    (Kubernetes reason; InvalidResponse for a body that is not JSON), `message`."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


# What an API call raises when it fails: an error answer (ApiError), or no answer at all (the
# connection refused or dropped, DNS, TLS: aiohttp.ClientError; no answer in time).
API_ERRORS: tuple[type[Exception], ...] = (ApiError, aiohttp.ClientError, TimeoutError)


def _json_object(text: str) -> dict[str, Any]:
    """The JSON object in `text` (a Kubernetes Status), else {}."""
    try:
        payload = json.loads(text)
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _pem(data: str | bytes) -> bytes:
    """kubeconfig `*-data` fields are base64 of PEM; kopf may hand over PEM itself."""
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def _write_temp(data: str | bytes) -> str:
    # ssl.load_cert_chain reads only files.
    with tempfile.NamedTemporaryFile(delete=False, suffix=".pem") as f:
        f.write(_pem(data))
        return f.name


def ssl_context(info: Any) -> ssl.SSLContext | bool:
    """An SSL context for a kopf.ConnectionInfo (False: plain HTTP or verification off)."""
    if not str(info.server).startswith("https") or info.insecure:
        return False
    ctx = ssl.create_default_context(
        cafile=str(info.ca_path) if info.ca_path else None,
        cadata=_pem(info.ca_data).decode() if info.ca_data else None,
    )
    cert = info.certificate_path or (info.certificate_data and _write_temp(info.certificate_data))
    key = info.private_key_path or (info.private_key_data and _write_temp(info.private_key_data))
    if cert:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key) if key else None)
    return ctx


class KubeClient:
    """Async calls to one API server. Create it inside the event loop that will use it."""

    def __init__(self, server: str, *, headers: Mapping[str, str] | None = None,
                 ssl_context: ssl.SSLContext | bool = False) -> None:
        self.server = server.rstrip("/")
        # A distinct User-Agent: audit logs (and the RBAC test) tell our calls from kopf's.
        self._headers = {"User-Agent": USER_AGENT, **dict(headers or {})}
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        # Discovery path -> (when it was asked, the resource names served there).
        self._discovery: dict[str, tuple[float, frozenset[str]]] = {}

    @classmethod
    def from_connection_info(cls, info: Any) -> KubeClient:
        """From the kopf.ConnectionInfo that kopf's login handlers return."""
        return cls(info.server, headers=info.as_http_headers(), ssl_context=ssl_context(info))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None,
                      params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        """One API call; returns the decoded JSON body; raises ApiError on an error status
        (whatever its body) or on a body that is not JSON."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=30), headers=self._headers)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(method, self.server + path, data=data, params=params,
                                         headers=headers, ssl=self._ssl) as resp:
            # errors="replace": a proxy's page in another charset is an ApiError below, not a
            # UnicodeDecodeError.
            text = await resp.text(errors="replace")
        # The status first: a proxy in front of the API server answers a 502/503/504 in plain
        # text, which must be an API error (retried), never a ValueError (which callers could
        # take for a refused spec).
        if resp.status >= 400:
            p = _json_object(text)
            raise ApiError(resp.status, str(p.get("reason", resp.reason)),
                           str(p.get("message", text[:500])))
        try:
            return json.loads(text) if text else None
        except ValueError:
            raise ApiError(resp.status, "InvalidResponse",
                           f"the answer is not JSON: {text[:500]!r}") from None

    # --- verbs -------------------------------------------------------------------------------

    async def get(self, res: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        """GET one object; None when it does not exist."""
        try:
            return await self.request("GET", res.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, res: Resource, namespace: str | None, *,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        """The objects in `namespace` (None: in every namespace)."""
        params = {"labelSelector": label_selector} if label_selector else None
        payload = await self.request("GET", res.path(namespace), params=params)
        return list(payload.get("items", []))

    async def create(self, res: Resource, namespace: str, body: Mapping[str, Any]
                     ) -> dict[str, Any]:
        return await self.request("POST", res.path(namespace), body=body)

    async def patch(self, res: Resource, namespace: str, name: str, patch: Mapping[str, Any],
                    *, subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386): nested objects merge, lists replace, null deletes."""
        return await self.request("PATCH", res.path(namespace, name, subresource), body=patch,
                                  content_type="application/merge-patch+json")

    async def delete(self, res: Resource, namespace: str, name: str) -> bool:
        """Delete (dependents in the background); False when it was already gone."""
        try:
            await self.request("DELETE", res.path(namespace, name),
                               body={"propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def has_resource(self, res: Resource, *, fresh: bool = False) -> bool:
        """API discovery (no RBAC needed): is this resource type served, e.g. is the
        ServiceMonitor CRD installed? An answer is reused for DISCOVERY_CACHE_SECONDS;
        `fresh` asks the API server anyway (and keeps that answer for the next callers)."""
        base = res.discovery_path
        cached = self._discovery.get(base)
        if (not fresh and cached is not None
                and time.monotonic() - cached[0] < DISCOVERY_CACHE_SECONDS):
            return res.plural in cached[1]
        asked_at = time.monotonic()
        try:
            payload = await self.request("GET", base)
            served = frozenset(r.get("name") for r in payload.get("resources", []))
        except ApiError as exc:
            # Only 404 says the group-version is not served. Any other error (a proxy's 503,
            # say) is no answer: raised and not cached, so a reconcile fails and is retried
            # rather than skip (or never delete) the ServiceMonitor, and the next call asks.
            if exc.status != 404:
                raise
            served = frozenset()
        # A slow answer to an earlier question must not replace a fresher one (a reconcile's
        # "absent" landing after the CRD handler's fresh "served").
        latest = self._discovery.get(base)
        if latest is None or latest[0] <= asked_at:
            self._discovery[base] = (asked_at, served)
        return res.plural in served

    def forget_discovery(self, res: Resource) -> None:
        """Drop the cached discovery answer for `res`'s group-version (its CRD changed)."""
        self._discovery.pop(res.discovery_path, None)
