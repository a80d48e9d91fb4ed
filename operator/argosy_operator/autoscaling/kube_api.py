"""The few Kubernetes API calls the autoscaling timer makes, over kopf's authenticated session.

kopf already logged in (kubeconfig, in-cluster service account or a login handler); its client
functions reuse those credentials, so the timer needs no client library of its own. They are
kopf internals (`kopf._cogs.clients`), so they are wrapped here and nowhere else: if kopf moves
them, only this file changes. Usable only inside a running kopf operator (handlers, timers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import kopf
from kopf._cogs.clients import api as _kopf_api
from kopf._cogs.clients import errors as _kopf_errors

_SETTINGS = kopf.OperatorSettings()  # only its networking timeouts/backoffs are used
_MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}

ApiError = _kopf_errors.APIError
NotFound = _kopf_errors.APINotFoundError


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/deployments/{quote(name)}"


def pods_path(namespace: str, match_labels: Mapping[str, str]) -> str:
    selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
    return f"/api/v1/namespaces/{quote(namespace)}/pods?" + urlencode({"labelSelector": selector})


async def get(path: str, logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    """GET a JSON object; raises `NotFound` on 404, `ApiError` on other API errors."""
    return await _kopf_api.get(path, settings=_SETTINGS, logger=logger)


async def merge_patch(path: str, body: Mapping[str, Any],
                      logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    """PATCH with a JSON merge patch; returns the patched object."""
    return await _kopf_api.patch(path, payload=dict(body), headers=_MERGE_PATCH,
                                 settings=_SETTINGS, logger=logger)
