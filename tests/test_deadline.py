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

Scope = Callable[[float], Any]


class _Ours:
    """``Deadline`` behind the asynchronous interface the cases are written against."""

    def __init__(self, when: float) -> None:
        self.when = when

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        assert task is not None
        self.deadline = Deadline(task, self.when)
        return self.deadline.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.deadline.__exit__(*exc)


SCOPES: dict[str, Scope] = {"asyncio": asyncio.timeout_at, "ours": _Ours}


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


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_it_ends_as_asyncios_timeout_at_does(case: Any) -> None:
    ours, theirs = _outcome(case, SCOPES["ours"]), _outcome(case, SCOPES["asyncio"])
    assert ours == theirs


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
