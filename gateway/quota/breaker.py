"""A circuit breaker in front of Redis, so no request waits on a store that is down.

Closed: every admission asks Redis. A failed or timed-out call opens it for ``breaker_open_s``,
during which no request touches Redis. Then exactly one request probes it (half-open) while the
others keep to the store-down policy; the probe's success closes the breaker, its failure opens it
for another period. Envoy's outlier detection ejects an upstream the same way.
"""

from __future__ import annotations

from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"


class Breaker:
    __slots__ = ("_clock", "_open_s", "_open_until", "_probing", "state")

    def __init__(self, open_s: float, clock: Callable[[], float]) -> None:
        self._open_s = open_s
        self._clock = clock
        self.state = CLOSED
        self._open_until = 0.0
        self._probing = False

    def attempt(self) -> str | None:
        """``"call"`` (closed), ``"probe"`` (this caller tries a half-open Redis), or ``None`` (keep off)."""
        if self.state == CLOSED:
            return "call"
        if self._probing or self._clock() < self._open_until:
            return None
        self._probing = True
        return "probe"

    def succeeded(self, probe: bool) -> bool:
        """True when this closes the breaker. A call that began before the breaker opened and
        succeeds late proves less than the probe does: only the probe closes it."""
        if self.state == CLOSED or not probe:
            return False
        self.state = CLOSED
        self._probing = False
        return True

    def failed(self, probe: bool) -> bool:
        """True when this opens a closed breaker."""
        if self.state == CLOSED:
            self.state = OPEN
            self._open_until = self._clock() + self._open_s
            return True
        if probe:
            self._probing = False
            self._open_until = self._clock() + self._open_s
        return False

    def abandoned(self) -> None:
        """The probe was cancelled before it learned anything: the next caller probes instead."""
        self._probing = False
