"""The configuration of a model whose replicas are discovered in Kubernetes (a model's
`kubernetes:` in the gateway's config file; backends/kubernetes.py discovers them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from argosy_runtime.gateway.config_checks import positive

DISCOVERY_SOURCES = ("pods", "endpointslices")
# The label the Argosy operator selects an LLMDeployment's runtime pods by (its value is the
# LLMDeployment's name); equal to argosy_operator.constants.LABEL_LLMD, kept literal here so the
# gateway does not depend on the operator package.
DEFAULT_INSTANCE_LABEL = "argosy.dev/llmdeployment"
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label


@dataclass(frozen=True)
class KubernetesBackendConfig:
    """Replicas discovered from the Pods (or EndpointSlices) of an LLMDeployment."""

    llmdeployment: str = ""
    namespace: str = "default"
    # Default selector: `argosy.dev/llmdeployment=<llmdeployment>`.
    label_selector: str | None = None
    source: str = "pods"
    port: int = 8000
    port_name: str = "http"
    # API server URL; default: in-cluster service account, else $KUBECONFIG / ~/.kube/config.
    api_url: str | None = None
    # Re-list this often even when the watch stream is quiet (a safety net, not the mechanism).
    resync_s: float = 300.0

    def __post_init__(self) -> None:
        # Checked here, not at discovery: a selector that is not a string (`label_selector:
        # 5`, or a YAML mapping of labels) fails every list call, which discovery retries
        # forever, logging a warning, and the model never gets a replica. A blank one would
        # select every pod of the namespace.
        if self.label_selector is not None and (
                not isinstance(self.label_selector, str) or not self.label_selector.strip()):
            raise ValueError(
                "kubernetes.label_selector: expected a Kubernetes label selector string such "
                f"as 'app=llm,tier in (a,b)', got {self.label_selector!r}")
        for key in ("llmdeployment", "namespace", "port_name"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"kubernetes.{key}: expected a string, got "
                                 f"{getattr(self, key)!r}")
        # Part of every API path: a blank one (`namespace: ""`) or one with a slash fails
        # every list call the same way, forever.
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError("kubernetes.namespace: expected a namespace name (lowercase "
                             f"letters, digits and '-'), got {self.namespace!r}")
        if self.api_url is not None and not isinstance(self.api_url, str):
            raise ValueError(f"kubernetes.api_url: expected a URL string, got {self.api_url!r}")
        if not self.llmdeployment and not self.label_selector:
            raise ValueError("kubernetes.llmdeployment: required (or give label_selector)")
        if self.source not in DISCOVERY_SOURCES:
            raise ValueError(
                f"kubernetes.source: must be one of {DISCOVERY_SOURCES}, got {self.source!r}"
            )
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"kubernetes.port: must be a TCP port, got {self.port!r}")
        positive("kubernetes.resync_s", self.resync_s)

    @property
    def selector(self) -> str:
        """The label selector sent to the API server."""
        return self.label_selector or f"{DEFAULT_INSTANCE_LABEL}={self.llmdeployment}"
