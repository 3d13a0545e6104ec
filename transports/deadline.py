"""``asyncio.timeout_at``'s contract in a plain ``with`` block, for the request path's deadlines.

Every streamed request enters up to three deadlines (the body's, which HTTP/1.1's protocol keeps
itself; connect and first token's; the total's).
Python 3.11's ``asyncio.Timeout`` is an asynchronous context manager: each scope makes and runs two
coroutines, looks up the current task and the running loop (each a ``getpid`` system call in
3.11) and walks a small state machine, ~2-3 µs a scope on this machine before its timer. Nothing in
entering or leaving a deadline needs to await, so ``Deadline`` does the same in ``__enter__`` and
``__exit__``, given the task it guards (the request's, which the caller already holds).

The semantics are 3.11.7's ``Timeout``: at ``when`` the task is cancelled; leaving the block with
that cancellation (and no other pending on the task since the block was entered) raises
``TimeoutError`` from it; a cancellation from elsewhere passes through, even when the deadline
expired in the same turn; a deadline already past cancels the task's next step; a scope is entered once.
``tests/test_deadline.py`` runs the same cases through both.

Given ``timers`` (``OrderedTimers``: the deadlines of one kind, which fall due in the order they
are set), a deadline waits there instead of in a loop timer of its own (~7-9 k instructions and
~0.6 KB each, for deadlines that almost never pass); one that would fall due before a pending one
takes its own timer, as without.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from transports.same_delay_timers import OrderedTimers

_CancelledError = asyncio.CancelledError


class Deadline:
    """Cancel ``task`` at loop time ``when`` unless the ``with`` block has ended; see module doc."""

    __slots__ = ("_cancelling", "_entered", "_expired", "_handle", "_task", "_timers", "_when")

    def __init__(self, task: asyncio.Task[object], when: float, timers: OrderedTimers | None = None) -> None:
        self._task = task
        self._when = when
        self._timers = timers  # where it waits when it can (see module doc)
        self._handle: asyncio.Handle | None = None
        self._expired = False
        self._entered = False
        self._cancelling = 0

    def __enter__(self) -> Deadline:
        if self._entered:
            raise RuntimeError("a Deadline is entered once")
        self._entered = True
        task = self._task
        self._cancelling = task.cancelling()
        loop = task.get_loop()
        if self._when <= loop.time():  # already past: before the task's next step, as asyncio's
            self._handle = loop.call_soon(self._expire)
        elif self._timers is None or not self._timers.set_at(loop, self, self._when, self._expire):
            self._handle = loop.call_at(self._when, self._expire)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        elif self._timers is not None:  # waiting in the shared timers (or run from them: nothing)
            self._timers.cancel(self)
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is _CancelledError:
            timeout = TimeoutError()
            timeout.__cause__ = exc  # ``raise ... from exc``, spelled out: mypyc's build drops ``from``
            raise timeout

    def expired(self) -> bool:
        """Whether the deadline passed while the block ran."""
        return self._expired

    def _expire(self) -> None:
        self._handle = None
        self._expired = True
        self._task.cancel()
