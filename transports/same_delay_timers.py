"""Timeouts that all run the same delay after they are set, sharing one event-loop timer.

A uvloop timer set and cancelled costs ~7-9 k instructions (~4 µs here: a handle, a libuv timer
started, stopped and closed, a context copied), and the request path set and cancelled several for
timeouts that almost never fire: an idle pod connection's keep-alive, a new connection's wait for
its first bytes. Timeouts of one fixed delay expire in the order they were set, so they can wait in
a dict (which keeps insertion order) with one loop timer armed for the oldest: setting one is a
dict insert and cancelling it a removal, ~2.8 k instructions the pair (libev's "be smart about
timeouts"; nginx and Envoy keep their timers in trees for the same reason). The loop timer fires at
the oldest entry's deadline (to the loop clock's millisecond), runs every entry that is due, and is
armed again for the next; an entry cancelled meanwhile costs nothing more.

``OrderedTimers`` is the same for deadlines given as times: the request path's first-token and
total deadlines are each the request's arrival plus one budget, so they too come in the order they
fall due, almost always. One that would fall due before a pending one is refused (``set_at`` says
so), and its caller arms a loop timer of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable


class OrderedTimers:
    """``callback`` of each key set here runs at its time, unless cancelled; times must come in
    order (``set_at``).

    Bound to the loop of the first ``set_at``; set from another loop (a process that runs one after
    another), it forgets what the previous loop left pending."""

    __slots__ = ("_armed", "_due", "_handle", "_last", "_loop")

    def __init__(self) -> None:
        self._due: dict[Hashable, tuple[float, Callable[[], object]]] = {}
        self._handle: asyncio.TimerHandle | object | None = None
        self._armed = 0.0  # the time the loop timer is set for
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last = 0.0  # the latest time set while any is pending: the map stays in time order

    @property
    def pending(self) -> int:
        """Timeouts set and not yet run or cancelled. (Not ``__len__``: an empty one is not false.)"""
        return len(self._due)

    def set_at(
        self, loop: asyncio.AbstractEventLoop, key: Hashable, when: float, callback: Callable[[], object]
    ) -> bool:
        """Run ``callback`` at loop time ``when``; False, and nothing set, when a pending one falls
        due after it. A key already set loses its old time either way."""
        if loop is not self._loop:
            self._due.clear()
            self._handle = None
            self._loop = loop
        due = self._due
        if key in due:
            del due[key]  # to the end: the map stays in deadline order
        if due:
            if when < self._last:
                return False
        elif self._handle is not None and self._handle is not _EXPIRING and when < self._armed:
            # Cancelled entries leave the loop timer armed for the first of them: later than this
            # one, it would run it late. (Those of one delay never come before it.)
            self._handle.cancel()  # type: ignore[union-attr,attr-defined]
            self._handle = None
        self._last = when
        due[key] = (when, callback)
        if self._handle is None:
            self._handle = loop.call_at(when, self._expire)
            self._armed = when
        return True

    def cancel(self, key: Hashable) -> None:
        """Forget ``key``'s timeout (nothing if it has none, or it has run)."""
        self._due.pop(key, None)

    def _expire(self) -> None:
        loop = self._loop
        assert loop is not None
        self._handle = _EXPIRING  # a callback that sets a timeout must not arm a timer of its own
        due = self._due
        # The loop's clock has 1 ms steps and rounds a timer's delay: its timer may run a hair before
        # ``when``. Within that, an entry is due (no re-arming to run a millisecond later).
        now = loop.time() + _RESOLUTION
        # The due ones are collected first, in one pass: finding a dict's first entry scans from its
        # start past the slots of entries already removed, so doing it once per entry is quadratic.
        ready = []
        for key, entry in due.items():
            if entry[0] > now:
                break
            ready.append((key, entry))
        try:
            for key, entry in ready:
                if due.get(key) != entry:  # (not ``is``: compiled, a tuple is rebuilt when read back)
                    continue  # cancelled, or set again, by a callback that ran before it
                del due[key]
                try:
                    entry[1]()
                except Exception as exc:  # one timeout's failure must not keep the others from running
                    loop.call_exception_handler(
                        {"message": FAILED, "exception": exc, "callback": entry[1]}
                    )
        finally:
            self._handle = None
            if due and self._loop is loop:
                self._armed = next(iter(due.values()))[0]
                self._handle = loop.call_at(self._armed, self._expire)


class SameDelayTimers(OrderedTimers):
    """``callback`` of each key set here runs ``delay`` seconds after it was set, unless cancelled."""

    __slots__ = ("_delay",)

    def __init__(self, delay: float) -> None:
        super().__init__()
        self._delay = delay

    def set(self, loop: asyncio.AbstractEventLoop, key: Hashable, callback: Callable[[], object]) -> None:
        """Run ``callback`` after the delay (a key already set starts again, with this callback).
        The loop's clock never goes back, so each is due no earlier than those set before it."""
        self.set_at(loop, key, loop.time() + self._delay, callback)


_EXPIRING = object()  # stands in for the loop timer while due callbacks run (``_expire``)
_RESOLUTION = 0.001  # the loop clock's step (uvloop: libuv's milliseconds)
FAILED = "a timeout's callback failed"  # the loop's exception handler's message for one
