"""Checks shared by the gateway's configuration dataclasses (config.py, kubernetes_config.py,
tenant_config.py): each raises a ValueError naming the offending field."""

from __future__ import annotations

import dataclasses
from typing import Any


def check_keys(where: str, data: dict[str, Any], cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown field (known: {', '.join(sorted(known))})")


def build(cls: type, where: str, data: Any) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    check_keys(where, data, cls)
    try:
        return cls(**data)
    except TypeError as exc:  # a wrong type that __post_init__ did not catch
        raise ValueError(f"{where}: {exc}") from exc


def positive(where: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    # "not >= 0": NaN (YAML's .nan) compares false with everything, and passed a "< 0" test
    if not value >= 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def positive_int(where: str, value: Any, *, allow_zero: bool = False) -> None:
    """A count (tries, characters, entries, replicas): an int, not merely a number. A float
    such as `max_attempts: 1.5` would pass `_positive`, start, and then fail every request
    (the code slices and ranges with these), instead of stopping the start-up."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
            value == 0 and not allow_zero):
        kind = "an integer >= 0" if allow_zero else "a positive integer"
        raise ValueError(f"{where}: expected {kind}, got {value!r}")
