"""Reading a gateway's scale-from-zero stamp (argosy_operator.autoscaling.activation)."""

from __future__ import annotations

from typing import Any

import pytest
from argosy_operator.autoscaling.activation import activation_requested, parse_rfc3339
from argosy_operator.constants import ANNOTATION_ACTIVATION

NOW = parse_rfc3339("2026-12-03T18:00:00Z")
assert NOW is not None


def llmd(stamp: str | None, last_scale: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "m"}
    if stamp is not None:
        meta["annotations"] = {ANNOTATION_ACTIVATION: stamp, "other": "x"}
    return {"metadata": meta, "status": {"lastScaleTime": last_scale} if last_scale else {}}


def test_parse_rfc3339() -> None:
    assert parse_rfc3339("2026-12-03T18:00:00Z") == NOW
    assert parse_rfc3339("2026-12-03T18:00:00.500000Z") == NOW + 0.5
    assert parse_rfc3339("2026-12-03T19:00:00+01:00") == NOW
    for bad in ("", "yesterday", "2026-12-03T18:00:00", None, 17):
        assert parse_rfc3339(bad) is None  # no zone: ambiguous, ignored


@pytest.mark.parametrize(("stamp", "last_scale", "last_scale_wall", "expected"), [
    ("2026-12-03T17:59:50Z", None, None, True),
    ("2026-12-03T17:58:59Z", None, None, False),                    # older than FRESH_SECONDS
    ("2026-12-03T18:00:30Z", None, None, True),                     # a gateway clock ahead
    ("2026-12-03T17:59:50Z", "2026-12-03T17:59:55Z", None, False),  # answered by that scaling
    ("2026-12-03T17:59:55Z", "2026-12-03T17:59:55Z", None, True),   # the same second counts
    ("2026-12-03T17:59:50Z", "2026-12-03T17:00:00Z", NOW - 5, False),  # status not yet updated
    ("2026-12-03T17:59:58Z", "2026-12-03T17:00:00Z", NOW - 5, True),
    (None, None, None, False),
    ("garbage", None, None, False),
])
def test_activation_requested(stamp: str | None, last_scale: str | None,
                              last_scale_wall: float | None, expected: bool) -> None:
    assert activation_requested(llmd(stamp, last_scale), last_scale_wall, NOW) is expected

