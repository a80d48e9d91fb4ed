"""Just enough of a Kubernetes API client for discovery: where the API is and how to log in.

In a pod: the service account (token, CA, KUBERNETES_SERVICE_HOST). Outside: $KUBECONFIG or
~/.kube/config (current context; bearer token or client certificate). Or an explicit URL (tests
point this at an in-process API emulator). No kubernetes client package: the gateway image stays
small and aiohttp already speaks HTTP.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class KubeAPI:
    """Base URL, headers and TLS context for API requests."""

    base_url: str
    token: str | None = None
    ssl_context: ssl.SSLContext | bool | None = None
    # Where `token` comes from, read again on every use: a pod's service-account token is a
    # projected, bound token that kubelet rotates in place (hourly) and that expires, so a
    # client must reload it (as client-go does); read once, discovery (and activation) would
    # fail with 401 once it expired and keep routing to the last membership for good.
    token_file: Path | None = None

    @property
    def headers(self) -> dict[str, str]:
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError:  # mid-rotation or gone: the last token read is the best guess
                token = ""
            if token:
                self.token = token
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def _data_or_file(entry: dict[str, Any], key: str) -> str | None:
    """A kubeconfig `<key>-data` (base64, written to a private temp file) or `<key>` (a path)."""
    if entry.get(f"{key}-data"):
        fd, path = tempfile.mkstemp(prefix="argosy-kube-")
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(entry[f"{key}-data"]))
        return path
    return entry.get(key)


def from_kubeconfig(path: str | Path) -> KubeAPI:
    """The current context of a kubeconfig file."""
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    by_name = lambda kind: {e["name"]: e[kind[:-1]] for e in cfg.get(kind) or []}  # noqa: E731
    context = by_name("contexts").get(cfg.get("current-context", ""))
    if context is None:
        raise ValueError(f"kubeconfig {path}: no current-context")
    cluster = by_name("clusters")[context["cluster"]]
    user = by_name("users").get(context.get("user", ""), {}) or {}
    server = cluster["server"].rstrip("/")
    ctx: ssl.SSLContext | bool | None = None
    if server.startswith("https://"):
        if cluster.get("insecure-skip-tls-verify"):
            ctx = False
        else:
            ctx = ssl.create_default_context(cafile=_data_or_file(cluster, "certificate-authority"))
        cert = _data_or_file(user, "client-certificate")
        key = _data_or_file(user, "client-key")
        if cert and key and isinstance(ctx, ssl.SSLContext):
            ctx.load_cert_chain(cert, key)
    token = user.get("token")
    token_file = None
    if not token and user.get("tokenFile"):
        token_file = Path(user["tokenFile"])
        token = token_file.read_text().strip()
    return KubeAPI(base_url=server, token=token, ssl_context=ctx, token_file=token_file)


def resolve(api_url: str | None = None) -> KubeAPI:
    """Explicit URL, else in-cluster service account, else kubeconfig."""
    if api_url:
        return KubeAPI(base_url=api_url.rstrip("/"))
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if host and (SERVICE_ACCOUNT / "token").exists():
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:  # IPv6
            host = f"[{host}]"
        return KubeAPI(
            base_url=f"https://{host}:{port}",
            token=(SERVICE_ACCOUNT / "token").read_text().strip(),
            ssl_context=ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt")),
            token_file=SERVICE_ACCOUNT / "token",
        )
    path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(
        Path.home() / ".kube" / "config"
    )
    if not Path(path).exists():
        raise ValueError(
            "kubernetes.api_url: not set, not running in a pod, and no kubeconfig at " + path
        )
    return from_kubeconfig(path)
