"""What one admission check found: the verdict and the counts the rate-limit headers report.

Windows are fixed clock minutes aligned to the epoch (``int(now // 60)``), as Envoy's rate limit
service counts: every replica agrees on the window from its own (NTP-synced) clock without asking
anyone, and a window's counters expire with it. The price is a burst of up to twice a limit across
a minute boundary, which OpenAI-style clients see as "resets in N s" in the headers anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_S = 60


def window_of(now: float) -> int:
    return int(now // WINDOW_S)


def reset_in(now: float) -> float:
    """Seconds until the current window ends (in (0, 60])."""
    return WINDOW_S - (now % WINDOW_S)


@dataclass(slots=True)
class Decision:
    refused: str | None  # None (admitted), "requests", "tokens" or "concurrency"
    window: int
    reset_s: float
    requests: int  # the window's request count (including this one when admitted)
    tokens: int  # the window's token count (including this reservation when admitted)
    streams: int  # streams held by the subject (including this one when admitted)
