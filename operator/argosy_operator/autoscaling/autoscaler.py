"""`Autoscaler`: a metrics window plus the decision state, for callers that tick in a loop.

Each tick: `observe(sample)` then `decide(current_replicas, now)`. The operator keeps one per
LLMDeployment, the simulator one per trace, `argosy fleet` one per model.
"""

from __future__ import annotations

from argosy_operator.autoscaling.decision import Decision, DecisionState, decide
from argosy_operator.autoscaling.metrics_window import MetricsWindow
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.autoscaling.samples import MetricsSample


class Autoscaler:
    """Holds what the pure `decide` needs between ticks; `policy` may be replaced at any time."""

    def __init__(self, policy: AutoscalingPolicy) -> None:
        self.policy = policy
        self.window = MetricsWindow(keep_seconds=self._keep_seconds(policy))
        self.state = DecisionState()
        self.last_decision: Decision | None = None

    def update_policy(self, policy: AutoscalingPolicy) -> None:
        """Adopt an edited policy, keeping the history gathered so far."""
        self.policy = policy
        self.window.keep_seconds = self._keep_seconds(policy)

    @staticmethod
    def _keep_seconds(policy: AutoscalingPolicy) -> float:
        # One scrape interval more than the windows: the idleness check compares each sample
        # with the one before (requests finished in between), which a scrape interval longer
        # than the stable window would otherwise have dropped (as `argosy fleet` keeps too).
        return policy.history_seconds + policy.scrape_interval_seconds

    def observe(self, sample: MetricsSample) -> None:
        self.window.add(sample)

    def decide(self, current_replicas: int, now: float) -> Decision:
        decision = decide(self.policy, current_replicas, self.window.samples(), self.state, now)
        self.state = decision.state
        self.last_decision = decision
        return decision
