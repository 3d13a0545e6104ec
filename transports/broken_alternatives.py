"""Memory of broken alternative services, with Chromium's exponential backoff.

When QUIC to an origin fails while TCP to it works (UDP blocked by a firewall, a middlebox that
drops QUIC), retrying QUIC on every request would cost each one the race delay. So the alternative
is marked broken for 300 s, then 600 s, 1200 s, ... up to about two days on each repeat; while
marked, the client goes straight to TCP; once the mark expires QUIC is tried again, and a success
clears the history. Keys are opaque (the client uses origin + alternative authority); the clock is
injectable so expiry is tested without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

INITIAL_DELAY = 300.0  # Chromium's kDefaultBrokenAlternativeProtocolDelay
MAX_DELAY = 2 * 24 * 3600.0  # Chromium's kMaxBrokenAlternativeProtocolDelay


@dataclass
class _Mark:
    failures: int
    until: float


class BrokenAlternatives:
    """Per-key broken marks: ``mark_broken`` doubles the interval each time, ``confirm`` clears.

    An expired mark stops blocking (``is_broken`` is False) but is remembered as *recently broken*
    until a success confirms the alternative, so the next failure backs off further rather than
    starting again at 300 s.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        initial_delay: float = INITIAL_DELAY,
        max_delay: float = MAX_DELAY,
    ) -> None:
        self._clock = clock
        self.initial_delay = initial_delay
        self.max_delay = max_delay
        self._marks: dict[Hashable, _Mark] = {}

    def mark_broken(self, key: Hashable) -> float:
        """Record a failure; returns how long (seconds) the alternative is now avoided."""
        mark = self._marks.get(key)
        failures = (mark.failures if mark else 0) + 1
        delay = min(self.initial_delay * 2 ** min(failures - 1, 30), self.max_delay)
        self._marks[key] = _Mark(failures, self._clock() + delay)
        return delay

    def is_broken(self, key: Hashable) -> bool:
        """True while a mark is in force: do not try the alternative."""
        mark = self._marks.get(key)
        return mark is not None and self._clock() < mark.until

    def is_recently_broken(self, key: Hashable) -> bool:
        """True when the alternative failed before and has not worked since (marked or expired)."""
        return key in self._marks

    def broken_until(self, key: Hashable) -> float | None:
        """When the current mark expires (clock units), or None when not marked."""
        mark = self._marks.get(key)
        return mark.until if mark is not None and self._clock() < mark.until else None

    def failures(self, key: Hashable) -> int:
        """How many times in a row the alternative has been marked broken."""
        mark = self._marks.get(key)
        return mark.failures if mark else 0

    def confirm(self, key: Hashable) -> None:
        """The alternative worked: forget its failures."""
        self._marks.pop(key, None)
