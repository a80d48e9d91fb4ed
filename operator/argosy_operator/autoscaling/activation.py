"""Scale from zero in a cluster: is a gateway holding requests for this LLMDeployment?

At zero replicas there is nothing to scrape. A gateway (`argosy gateway`, a model route with
`activation`) that receives a request for a deployment with no ready replica holds it and
merge-patches the annotation `argosy.dev/activation-requested: <RFC3339 time>` onto the
LLMDeployment, again every few seconds while it keeps holding. At zero replicas the timer turns
a fresh stamp into `MetricsSample.held_requests`, and the decision scales 0 -> 1.

A stamp counts when it is at most `FRESH_SECONDS` old and not older than the last scaling (the
status' `lastScaleTime`, or this process' own last scaling, which the status read may not show
yet): a stamp written before a scale-to-zero was answered already by the replica that was there.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from argosy_operator.constants import ANNOTATION_ACTIVATION

# The gateway refreshes its stamp every 15 s while it holds requests (gateway/activation.py),
# so a live demand is never older than this; a stamp from a gateway that went away expires.
FRESH_SECONDS = 60.0


def parse_rfc3339(value: Any) -> float | None:
    """Epoch seconds of an RFC3339 time (`2026-12-03T17:40:00Z`, fractions allowed), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return parsed.timestamp()


def activation_requested(llmd: Mapping[str, Any], last_scale_wall: float | None,
                         now: float) -> bool:
    """Whether a gateway asked for a replica recently (see the module docstring).

    llmd: the LLMDeployment; last_scale_wall: epoch seconds this process last changed the
    replica count (None if never); now: epoch seconds.
    """
    annotations = (llmd.get("metadata") or {}).get("annotations") or {}
    requested = parse_rfc3339(annotations.get(ANNOTATION_ACTIVATION))
    if requested is None:
        return False
    last_scale = parse_rfc3339((llmd.get("status") or {}).get("lastScaleTime"))
    for scaled in (last_scale, last_scale_wall):
        # Stamps have second precision: one from the very second of a scaling counts.
        if scaled is not None and requested < int(scaled):
            return False
    return abs(now - requested) <= FRESH_SECONDS  # abs: a gateway's clock may run a little ahead
