"""Three-way JSON merge patches: change only the fields the operator owns.

Like `kubectl apply` (client-side), the operator remembers the manifest it last applied to a
child (in an annotation) and patches the live object with:

- every field of the desired manifest that the live object does not already hold (a drift or a
  spec change), compared leniently: the live object may carry extra keys the API server
  defaulted or other controllers added, and those are left alone;
- `null` for every field the operator applied last time but no longer wants.

Lists are atomic in JSON merge patch, so a list that differs is sent whole (a list "holds" the
desired one when it has the same length and each item holds the desired item). A list that
changed since it was last applied is sent whole even when the live one holds the new one: a key
the operator no longer sets inside a list item (a container's CPU request, its preStop hook, an
emptyDir's sizeLimit) looks like an extra key the API server defaulted and would stay forever.
Sent whole, the list replaces the live one and the API server fills its defaults in again.
An empty patch means the child is already as desired: no API call, no rollout, no event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MISSING = object()


def holds(live: Any, desired: Any) -> bool:
    """Whether `live` already holds everything in `desired` (extra live keys are fine)."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(k in live and holds(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(holds(a, b) for a, b in zip(live, desired, strict=True)))
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    return bool(live == desired)


def _list_changed(last_applied: Any, desired: Any) -> bool:
    """Whether `desired` is a list that differs from the one applied last time."""
    return isinstance(desired, list) and isinstance(last_applied, list) \
        and desired != last_applied


def three_way_merge_patch(last_applied: Mapping[str, Any] | None,
                          desired: Mapping[str, Any],
                          live: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that takes `live` to `desired` on the operator's fields ({} if none)."""
    last = last_applied or {}
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = live.get(key, _MISSING)
        if isinstance(want, Mapping) and isinstance(have, Mapping):
            last_sub = last.get(key)
            sub = three_way_merge_patch(last_sub if isinstance(last_sub, Mapping) else None,
                                        want, have)
            if sub:
                patch[key] = sub
        elif have is _MISSING or not holds(have, want) or _list_changed(last.get(key), want):
            patch[key] = want
    for key in last:
        if key not in desired and key in live:
            patch[key] = None
    return patch
