"""Reading a number off a server's /metrics page (Prometheus text) in the bench/ scripts."""

from __future__ import annotations

import re


def metric_sum(text: str, name: str) -> float | None:
    """The sum over label sets of the Prometheus sample `name` (None when the page has none)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)
    values = [float(v) for v in pattern.findall(text)]
    return sum(values) if values else None
