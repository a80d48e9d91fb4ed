"""Names, labels and owner references shared by every child of an LLMDeployment."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from argosy_operator.constants import (
    API_VERSION,
    APP_NAME,
    COMPONENT,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_LLMD,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    OPERATOR_NAME,
)
from argosy_operator.spec import InvalidSpecError

# A DNS-1035 label: what a Service may be named (the strictest rule a child's name meets).
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LENGTH = 63


def check_name(name: str) -> None:
    """Raise InvalidSpecError unless the LLMDeployment's `name` can name its children.

    Kubernetes admits any DNS subdomain as the LLMDeployment's name (dots, a leading digit,
    up to 253 characters), but its Service takes the same name, which must be a DNS-1035
    label, and every child and pod carries the name as a label value (at most 63
    characters). Checked before any child is written: otherwise the Deployment would be
    created and the Service refused on every retry."""
    # fullmatch: `$` alone also matches before a final newline, which Kubernetes refuses.
    if len(name) > MAX_NAME_LENGTH or not _DNS1035_LABEL.fullmatch(name):
        raise InvalidSpecError(
            f"metadata.name: {name!r} cannot name the children (the Service takes the same "
            f"name): use at most {MAX_NAME_LENGTH} characters, lowercase letters, digits and "
            "'-', starting with a letter and ending with a letter or digit; the name cannot "
            "change, so create the LLMDeployment again under such a name")


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's (immutable) pod selector: just the owner's name."""
    return {LABEL_LLMD: name}


def common_labels(name: str) -> dict[str, str]:
    """Labels on every child and every pod."""
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: COMPONENT,
        LABEL_MANAGED_BY: OPERATOR_NAME,
        LABEL_LLMD: name,
    }


def selector_string(name: str) -> str:
    """`status.selector` (the scale subresource's labelSelectorPath wants a string)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def owner_reference(llmd: Mapping[str, Any]) -> dict[str, Any]:
    """A controller reference so that deleting the LLMDeployment garbage-collects the child.

    blockOwnerDeletion is left unset: it would need update on llmdeployments/finalizers under
    the OwnerReferencesPermissionEnforcement admission plugin, and background deletion
    cascades without it.
    """
    meta = llmd["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def child_metadata(llmd: Mapping[str, Any], *, annotations: Mapping[str, str] | None = None
                   ) -> dict[str, Any]:
    """metadata of a child: same name and namespace as the owner, common labels, owner ref."""
    meta = llmd["metadata"]
    out: dict[str, Any] = {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": common_labels(meta["name"]),
        "ownerReferences": [owner_reference(llmd)],
    }
    if annotations:
        out["annotations"] = dict(annotations)
    return out


def endpoint_url(llmd: Mapping[str, Any], port: int) -> str:
    """The in-cluster base URL of the OpenAI API (the Service's DNS name)."""
    meta = llmd["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{port}/v1"
