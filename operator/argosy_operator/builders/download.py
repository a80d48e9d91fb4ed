"""The model-download init container for `hf://` and `s3://` sources.

It writes into the shared `model` emptyDir that the runtime container mounts read-only; the
runtime then loads from a local path and never needs credentials or network access to a hub.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.hf_download import HF_DOWNLOAD_SCRIPT
from argosy_operator.builders.security import container_security_context
from argosy_operator.constants import (
    MODEL_MOUNT,
    MODEL_VOLUME,
    S3_DOWNLOADER_IMAGE,
    TMP_VOLUME,
)
from argosy_operator.model_source import DOWNLOAD_DIR, ModelSource

DOWNLOAD_CONTAINER = "model-download"


def download_command(source: ModelSource, revision: str) -> list[str]:
    """The init container's command for a source that needs a download."""
    if source.kind == "hf":
        return ["python3", "-c", HF_DOWNLOAD_SCRIPT, source.location, revision,
                source.file or "", DOWNLOAD_DIR]
    if source.kind == "s3":
        if source.single_file:
            return ["aws", "s3", "cp", "--only-show-errors", source.location, source.serve_path]
        return ["aws", "s3", "sync", "--only-show-errors", source.location.rstrip("/") + "/",
                DOWNLOAD_DIR]
    raise ValueError(f"spec.model.source: {source.kind} sources are not downloaded")


def download_container(spec: Mapping[str, Any], source: ModelSource, runtime_image: str,
                       pull_policy: str) -> dict[str, Any]:
    """The init container: the runtime image (Python) for hf://, the AWS CLI image for s3://."""
    model = spec["model"]
    container: dict[str, Any] = {
        "name": DOWNLOAD_CONTAINER,
        "image": runtime_image if source.kind == "hf" else S3_DOWNLOADER_IMAGE,
        "imagePullPolicy": pull_policy,
        "command": download_command(source, model.get("revision") or "main"),
        # HOME on the writable /tmp: the AWS CLI keeps its caches there.
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [
            {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT},
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
        ],
        "securityContext": container_security_context(),
    }
    if model.get("credentialsSecret"):
        # HF_TOKEN for hf://; AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION /
        # AWS_ENDPOINT_URL for s3:// (and S3-compatible stores).
        container["envFrom"] = [{"secretRef": {"name": model["credentialsSecret"]}}]
    return container
