"""Retry before the first token: which failures qualify, how long to back off, and the budget.

Like Envoy's and Finagle's retry budgets: retries may be at most a fraction of recent requests
(plus a small floor so a quiet gateway can still retry), so a failing fleet is not hammered by
a multiple of its normal load exactly when it can least take it.
"""

from __future__ import annotations

import random

from gateway.config import RetryConfig
from gateway.errors import GatewayError


class Retryable(Exception):
    """A failure before any byte reached the client, which another pod might not have."""

    def __init__(self, error: GatewayError, outcome: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


class RetryBudget:
    """Allows a retry while retries in the last ``window_s`` stay within ``ratio`` of requests."""

    def __init__(self, ratio: float, min_per_s: float, window_s: int = 10) -> None:
        self.ratio = ratio
        self.floor = min_per_s * window_s
        self.window_s = window_s
        self._requests = [0] * window_s
        self._retries = [0] * window_s
        self._second = 0

    def _advance(self, now: float) -> int:
        second = int(now)
        if second != self._second:
            for s in range(max(self._second + 1, second - self.window_s + 1), second + 1):
                self._requests[s % self.window_s] = 0
                self._retries[s % self.window_s] = 0
            self._second = second
        return second % self.window_s

    def record_request(self, now: float) -> None:
        self._requests[self._advance(now)] += 1

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it."""
        slot = self._advance(now)
        allowed = max(self.floor, self.ratio * sum(self._requests))
        if sum(self._retries) + 1 > allowed:
            return False
        self._retries[slot] += 1
        return True


def backoff_s(config: RetryConfig, retry: int) -> float:
    """Full-jitter exponential backoff before retry number ``retry`` (1-based)."""
    return random.uniform(0, min(config.backoff_max_s, config.backoff_base_s * 2 ** (retry - 1)))
