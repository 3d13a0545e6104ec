"""Canary rollouts: the judge that compares a canary with stable (see docs/canary.md)."""

from gateway.canary.judge import Judge, JudgeConfig, MetricEvidence, Tally, Verdict

__all__ = ["Judge", "JudgeConfig", "MetricEvidence", "Tally", "Verdict"]
