"""Quota counters in this process: the store without Redis, and the fallback when Redis is down.

The same semantics as the Redis script (fixed clock-minute windows, all-or-nothing reservation of
a request, its tokens and a stream slot) in a dict. Subjects with nothing in flight are dropped
when the next window begins, so memory follows the keys in use this minute, not every key ever seen.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.quota.decision import Decision, reset_in, window_of
from gateway.quota.policy import QuotaPolicy


class _Usage:
    __slots__ = ("requests", "streams", "tokens", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.requests = 0
        self.tokens = 0
        self.streams = 0


class MemoryCounters:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self._window = -1

    def __len__(self) -> int:
        return len(self._usage)

    def admit(self, subject: str, policy: QuotaPolicy, tokens: int) -> Decision:
        now = self._clock()
        window = window_of(now)
        if window != self._window:
            self._prune(window)
        usage = self._usage.get(subject)
        if usage is None:
            usage = self._usage[subject] = _Usage(window)
        elif usage.window != window:
            usage.window = window
            usage.requests = usage.tokens = 0
        refused = None
        if policy.requests_per_minute is not None and usage.requests + 1 > policy.requests_per_minute:
            refused = "requests"
        elif policy.tokens_per_minute is not None and usage.tokens + tokens > policy.tokens_per_minute:
            refused = "tokens"
        elif policy.max_concurrent is not None and usage.streams + 1 > policy.max_concurrent:
            refused = "concurrency"
        if refused is None:
            usage.requests += 1
            usage.tokens += tokens
            if policy.max_concurrent is not None:
                usage.streams += 1
        return Decision(refused, window, reset_in(now), usage.requests, usage.tokens, usage.streams)

    def seed(self, subject: str, window: int, requests: int, tokens: int) -> None:
        """Start ``subject``'s counts in ``window`` at no less than these: when Redis is lost
        mid-window, this replica's share of what the fleet had already admitted, so falling back
        to local counting does not hand out the window's whole quota a second time."""
        usage = self._usage.get(subject)
        if usage is None:
            usage = self._usage[subject] = _Usage(window)
        elif usage.window != window:
            if usage.window > window:
                return
            usage.window = window
            usage.requests = usage.tokens = 0
        usage.requests = max(usage.requests, requests)
        usage.tokens = max(usage.tokens, tokens)

    def settle(self, subject: str, window: int, refund: int, release: bool) -> None:
        """Give back ``refund`` tokens (negative: charge more) in ``window``, and the stream slot."""
        usage = self._usage.get(subject)
        if usage is None:
            return
        if usage.window == window:
            usage.tokens = max(0, usage.tokens - refund)
        if release and usage.streams > 0:
            usage.streams -= 1

    def _prune(self, window: int) -> None:
        self._window = window
        stale = [s for s, u in self._usage.items() if u.window < window and u.streams == 0]
        for subject in stale:
            del self._usage[subject]
