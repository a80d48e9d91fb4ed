"""The autoscaling policy: `spec.autoscaling` of an LLMDeployment as a frozen dataclass.

Field names are the CRD's camelCase ones in snake_case; defaults equal the CRD's defaults, so a
policy built from a partial (or empty) mapping behaves as the API server would have defaulted it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# camelCase key in spec.autoscaling -> dataclass field
_CAMEL_TO_FIELD: dict[str, str] = {
    "enabled": "enabled",
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "targetKVCacheUtilization": "target_kv_cache_utilization",
    "targetQueueDepth": "target_queue_depth",
    "tolerance": "tolerance",
    "stableWindowSeconds": "stable_window_seconds",
    "panicWindowSeconds": "panic_window_seconds",
    "panicThreshold": "panic_threshold",
    "scaleUpStabilizationSeconds": "scale_up_stabilization_seconds",
    "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds",
    "maxScaleUpRate": "max_scale_up_rate",
    "maxScaleDownRate": "max_scale_down_rate",
    "scrapeIntervalSeconds": "scrape_interval_seconds",
    "scaleToZeroIdleSeconds": "scale_to_zero_idle_seconds",
}
_FIELD_TO_CAMEL = {v: k for k, v in _CAMEL_TO_FIELD.items()}

# The CRD's maximum of autoscaling.maxReplicas, the same as that of spec.replicas.
MAX_REPLICAS = 1000


@dataclasses.dataclass(frozen=True)
class AutoscalingPolicy:
    """How one LLMDeployment scales; see docs/autoscaling.md for the meaning of each field."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_utilization: float = 0.7
    target_queue_depth: float = 4.0
    tolerance: float = 0.1
    stable_window_seconds: float = 60.0
    panic_window_seconds: float = 6.0
    panic_threshold: float = 2.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    max_scale_up_rate: float = 2.0
    max_scale_down_rate: float = 0.5
    scrape_interval_seconds: float = 5.0
    scale_to_zero_idle_seconds: float = 600.0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"spec.autoscaling.{_FIELD_TO_CAMEL[name]}: {why}")

        if not isinstance(self.enabled, bool):
            raise bad("enabled", f"must be a boolean, got {self.enabled!r}")
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, f"must be an integer, got {value!r}")
            if value < 0:
                raise bad(name, f"must be >= 0, got {value}")
        if self.max_replicas < 1:
            raise bad("max_replicas", f"must be >= 1, got {self.max_replicas}")
        if self.max_replicas > MAX_REPLICAS:
            raise bad("max_replicas", f"must be <= {MAX_REPLICAS}, got {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            raise bad("min_replicas", f"{self.min_replicas} exceeds maxReplicas {self.max_replicas}")
        for f in dataclasses.fields(self):
            if f.name in ("enabled", "min_replicas", "max_replicas"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(f.name, f"must be a finite number, got {value!r}")
        if not 0.0 < self.target_kv_cache_utilization <= 1.0:
            raise bad("target_kv_cache_utilization", "must be a fraction in (0, 1]")
        if self.target_queue_depth <= 0:
            raise bad("target_queue_depth", "must be > 0")
        if not 0.0 <= self.tolerance < 1.0:
            raise bad("tolerance", "must be in [0, 1)")
        if self.stable_window_seconds <= 0:
            raise bad("stable_window_seconds", "must be > 0")
        if not 0 < self.panic_window_seconds <= self.stable_window_seconds:
            raise bad("panic_window_seconds", "must be > 0 and <= stableWindowSeconds")
        if self.panic_threshold < 1.0:
            raise bad("panic_threshold", "must be >= 1 (a load/target ratio)")
        for name in ("scale_up_stabilization_seconds", "scale_down_stabilization_seconds",
                     "scale_to_zero_idle_seconds"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        # Bounds as in the CRD; a rate of 1 still allows one replica per decision.
        if self.max_scale_up_rate < 1.0:
            raise bad("max_scale_up_rate", "must be >= 1")
        if not 0.0 <= self.max_scale_down_rate <= 1.0:
            raise bad("max_scale_down_rate", "must be in [0, 1]")
        if self.scrape_interval_seconds <= 0:
            raise bad("scrape_interval_seconds", "must be > 0")

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any] | None) -> AutoscalingPolicy:
        """Build from the camelCase `spec.autoscaling` mapping; absent keys take the defaults.

        Unknown keys raise ValueError (a typo in a policy file must not be silently ignored).
        """
        if autoscaling is None:
            return cls()
        if not isinstance(autoscaling, Mapping):
            raise ValueError(f"spec.autoscaling: must be a mapping, got {type(autoscaling).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in autoscaling.items():
            if key not in _CAMEL_TO_FIELD:
                raise ValueError(f"spec.autoscaling.{key}: unknown field "
                                 f"(known: {', '.join(_CAMEL_TO_FIELD)})")
            kwargs[_CAMEL_TO_FIELD[key]] = value
        # Integers are accepted where floats are meant (YAML `60` for 60.0).
        for name, value in list(kwargs.items()):
            if name not in ("enabled", "min_replicas", "max_replicas") and isinstance(value, int) \
                    and not isinstance(value, bool):
                kwargs[name] = float(value)
        return cls(**kwargs)

    def to_spec(self) -> dict[str, Any]:
        """The camelCase mapping (round-trips through `from_spec`)."""
        return {_FIELD_TO_CAMEL[f.name]: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def history_seconds(self) -> float:
        """How far back samples are needed: the longest window the decision looks at."""
        return max(self.stable_window_seconds, self.panic_window_seconds)
