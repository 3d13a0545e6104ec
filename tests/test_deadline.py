"""``transports.deadline.Deadline`` keeps ``asyncio.timeout_at``'s contract: each case runs once
through asyncio's own scope and once through ours, and must end the same way (what was raised,
what the task's cancellation count is after, whether the deadline says it expired)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from transports.deadline import Deadline
from transports.same_delay_timers import OrderedTimers

Scope = Callable[[float], Any]
SHARED = OrderedTimers()  # the scope that waits in shared timers: each case's loop takes it over


class _Ours:
    """``Deadline`` behind the asynchronous interface the cases are written against."""

    timers: OrderedTimers | None = None

    def __init__(self, when: float) -> None:
        self.when = when

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        assert task is not None
        self.deadline = Deadline(task, self.when, self.timers)
        return self.deadline.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.deadline.__exit__(*exc)


class _OursShared(_Ours):
    """``Deadline`` waiting in shared ``OrderedTimers`` (one due before a pending one: its own timer)."""

    timers = SHARED


SCOPES: dict[str, Scope] = {"asyncio": asyncio.timeout_at, "ours": _Ours, "ours, shared": _OursShared}


async def _in_time(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() + 0.05) as d:
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)  # the timer is gone: nothing cancels the task later
    return d.expired()


async def _expires(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() + 0.01) as d:
        await loop.create_future()
    return d.expired()


async def _already_past(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() - 1) as d:
        await asyncio.sleep(0.05)
    return d.expired()


async def _past_at_the_next_step(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    """Already past when entered: the task's very next step is cancelled, not one loop turn later."""
    async with scope(loop.time() - 1) as d:
        await asyncio.sleep(0)
    return d.expired()


async def _cancelled_from_elsewhere(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    task = asyncio.current_task()
    assert task is not None
    loop.call_later(0.01, task.cancel)
    async with scope(loop.time() + 10) as d:
        await loop.create_future()
    return d.expired()


async def _both_in_one_turn(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    task = asyncio.current_task()
    assert task is not None
    async with scope(loop.time() - 1) as d:
        loop.call_soon(task.cancel)
        await asyncio.sleep(0.05)
    return d.expired()


async def _inner_expires(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() + 10) as outer:
        try:
            async with scope(loop.time() + 0.01) as inner:
                await loop.create_future()
        except TimeoutError:
            pass
        await asyncio.sleep(0)
    return outer.expired(), inner.expired()


async def _outer_expires(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() + 0.01) as outer, scope(loop.time() + 10) as inner:
        await loop.create_future()
    return outer.expired(), inner.expired()


async def _expired_then_other_error(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() + 0.01):
        try:
            await loop.create_future()
        except asyncio.CancelledError:
            raise ValueError("the block's own error") from None


async def _expiry_swallowed(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    async with scope(loop.time() + 0.01) as d:
        with contextlib.suppress(asyncio.CancelledError):
            await loop.create_future()
    return d.expired()


async def _entered_while_cancelling(scope: Scope, loop: asyncio.AbstractEventLoop) -> Any:
    """A task that caught a cancellation without ``uncancel`` (a cleanup that goes on): its own
    deadline still ends as a timeout, not as that earlier cancellation."""
    task = asyncio.current_task()
    assert task is not None
    loop.call_soon(task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await loop.create_future()
    async with scope(loop.time() + 0.01) as d:
        await loop.create_future()
    return d.expired()


CASES = [
    _in_time, _expires, _already_past, _past_at_the_next_step, _cancelled_from_elsewhere, _both_in_one_turn,
    _inner_expires, _outer_expires, _expired_then_other_error, _expiry_swallowed, _entered_while_cancelling,
]


def _outcome(case: Callable[[Scope, asyncio.AbstractEventLoop], Awaitable[Any]], scope: Scope) -> Any:
    async def main() -> Any:
        loop = asyncio.get_running_loop()

        async def guarded() -> Any:
            try:
                result: Any = ("returned", await case(scope, loop))
            except BaseException as exc:  # the outcome is what is compared
                result = ("raised", type(exc).__name__, type(exc.__cause__).__name__)
            task = asyncio.current_task()
            assert task is not None
            return result, task.cancelling()

        return await asyncio.create_task(guarded())

    return asyncio.run(main())


@pytest.mark.parametrize("scope", ["ours", "ours, shared"])
@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_it_ends_as_asyncios_timeout_at_does(case: Any, scope: str) -> None:
    ours, theirs = _outcome(case, SCOPES[scope]), _outcome(case, SCOPES["asyncio"])
    assert ours == theirs


def test_deadlines_in_order_share_one_set_and_one_due_earlier_takes_a_timer_of_its_own() -> None:
    """The request path's deadlines of one stage fall due in the order they are set: they wait in one
    set of timers, none with a loop timer of its own, and each still ends its block in time. One
    that falls due before a pending one (a tier with a shorter budget) takes its own, and ends in time."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        timers = OrderedTimers()

        async def block(after: float) -> tuple[float, float]:
            task = asyncio.current_task()
            assert task is not None
            begun = loop.time()
            deadline = Deadline(task, begun + after, timers)
            with pytest.raises(TimeoutError), deadline:
                await loop.create_future()
            return begun + after, loop.time()

        late = [asyncio.create_task(block(0.2)) for _ in range(3)]
        await asyncio.sleep(0)  # all three entered, in order
        assert timers.pending == 3
        early = asyncio.create_task(block(0.05))
        await asyncio.sleep(0)
        assert timers.pending == 3  # due before them: a loop timer of its own
        results = await asyncio.wait_for(asyncio.gather(early, *late), 5)
        for due, ended in results:
            assert due - 0.002 <= ended < due + 0.5  # the loop's clock has 1 ms steps
        assert results[0][1] < min(ended for _, ended in results[1:])
        assert timers.pending == 0

    asyncio.run(main())


def test_a_deadline_is_entered_once() -> None:
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        deadline = Deadline(task, task.get_loop().time() + 10)
        with deadline, pytest.raises(RuntimeError, match="entered once"), deadline:
            pass
        with pytest.raises(RuntimeError, match="entered once"), deadline:  # nor after it ended
            pass
        await asyncio.sleep(0)

    asyncio.run(main())
