"""A bounded, time-ordered window of `MetricsSample`s for one deployment."""

from __future__ import annotations

import collections

from argosy_operator.autoscaling.samples import MetricsSample


class MetricsWindow:
    """Keeps the samples of the last `keep_seconds` (and at most `max_samples` of them).

    The decision only looks back over the stable window, so older samples are dropped as new
    ones arrive; `max_samples` bounds memory even if the clock misbehaves.
    """

    def __init__(self, keep_seconds: float, max_samples: int = 4096) -> None:
        if keep_seconds <= 0:
            raise ValueError(f"keep_seconds: must be > 0, got {keep_seconds}")
        if max_samples < 1:
            raise ValueError(f"max_samples: must be >= 1, got {max_samples}")
        self.keep_seconds = float(keep_seconds)
        self._samples: collections.deque[MetricsSample] = collections.deque(maxlen=max_samples)

    def add(self, sample: MetricsSample) -> None:
        """Append a sample; one older than the newest is a clock error and raises ValueError."""
        if self._samples and sample.t < self._samples[-1].t:
            raise ValueError(f"sample t={sample.t} is older than the newest t={self._samples[-1].t}")
        self._samples.append(sample)
        cutoff = sample.t - self.keep_seconds
        while self._samples and self._samples[0].t <= cutoff:
            self._samples.popleft()

    def samples(self) -> tuple[MetricsSample, ...]:
        """Oldest first."""
        return tuple(self._samples)

    def __len__(self) -> int:
        return len(self._samples)
