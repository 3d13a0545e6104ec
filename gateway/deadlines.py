"""Staged timeouts: which budget applies to a request, and the errors that name the stage.

Four stages (connect, first token, stall, total), each with a default that a model's settings and
then the caller's tier (its API key's, see ``gateway/phases/authenticate.py``) may override; a client
may ask for a shorter total deadline with ``X-Request-Timeout-Ms``, never a longer one than its tier
allows.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import Config, StageOverrides
from gateway.errors import GatewayError, bad_request
from transports.same_delay_timers import OrderedTimers

CLIENT_TIMEOUT_HEADER = b"x-request-timeout-ms"
STAGES = ("connect", "first_token", "stall", "total")

# Where the request path's deadlines wait (``transports.deadline.Deadline``), one set per stage: a
# stage's deadline is the request's arrival plus its budget, so those of one stage fall due in the
# order they are set but for a tier or model with a shorter budget (those take a loop timer each).
FIRST_TOKEN_DEADLINES = OrderedTimers()
TOTAL_DEADLINES = OrderedTimers()


@dataclass(frozen=True, slots=True)
class Budget:
    """Seconds allowed for each stage of one request."""

    connect_s: float
    first_token_s: float
    stall_s: float
    total_s: float

    def merged(self, overrides: StageOverrides | None) -> Budget:
        if overrides is None:
            return self
        return Budget(
            overrides.connect_s or self.connect_s,
            overrides.first_token_s or self.first_token_s,
            overrides.stall_s or self.stall_s,
            overrides.total_s or self.total_s,
        )

    def capped(self, total_s: float) -> Budget:
        """The same budget with the total (and so every stage) at most ``total_s``."""
        return Budget(
            min(self.connect_s, total_s), min(self.first_token_s, total_s), self.stall_s,
            min(self.total_s, total_s),
        )


def timed_out(stage: str, seconds: float) -> GatewayError:
    """504 before anything was sent; the same object becomes an SSE error event afterwards."""
    what = {
        "connect": "connecting to a pod",
        "first_token": "waiting for the first token",
        "stall": "waiting for the next token",
        "total": "the whole request",
    }[stage]
    return GatewayError(
        504, f"Timed out {what} after {seconds:g} s (the '{stage}' timeout).", "timeout", stage
    )


class TimeoutPolicy:
    """Resolves a request's ``Budget`` from config, model, tier and the client's own deadline."""

    def __init__(self, config: Config) -> None:
        t = config.timeouts
        self._default = Budget(t.connect_s, t.first_token_s, t.stall_s, t.total_s)
        self._models = t.models
        self._tiers = config.tiers
        self._cache: dict[tuple[str, str | None], Budget] = {}

    def budget(self, model: str, tier: str | None, client_timeout_ms: bytes | None) -> Budget:
        """The stages for ``model`` and ``tier``, the total capped by the client's own deadline."""
        key = (model, tier)
        budget = self._cache.get(key)
        if budget is None:
            budget = self._default.merged(self._models.get(model))
            if tier is not None:
                budget = budget.merged(self._tiers[tier].timeouts)
            self._cache[key] = budget
        if client_timeout_ms is not None:
            return budget.capped(_client_deadline_s(client_timeout_ms))
        return budget


def _client_deadline_s(value: bytes) -> float:
    try:
        ms = int(value)
    except ValueError:
        ms = 0
    if ms <= 0:
        raise bad_request(
            "X-Request-Timeout-Ms must be a positive whole number of milliseconds.",
            "x-request-timeout-ms", "invalid_timeout",
        )
    return ms / 1000.0
