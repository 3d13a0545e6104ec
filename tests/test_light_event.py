"""transports.light_event.LightEvent against asyncio.Event: the same answers to the same calls.

A random sequence of ``set``, ``clear``, new waiters, cancelled waiters and loop turns runs against
each; after every step the flag and each waiter's state (pending, woken with True, cancelled) must
be the same. uvicorn's write flow control and the request's message event are LightEvents in the
gateway's HTTP/1.1 protocol (transports/h1_disconnect.py), checked over a real socket by the
back-pressure and disconnect tests.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from transports.light_event import LightEvent

STEPS = st.lists(st.sampled_from(["set", "clear", "wait", "cancel", "turn"]), max_size=40)


async def _observe(event: Any, steps: list[str]) -> list[tuple[Any, ...]]:
    waiters: list[asyncio.Task[bool]] = []
    seen: list[tuple[Any, ...]] = []
    for step in steps:
        if step == "set":
            event.set()
        elif step == "clear":
            event.clear()
        elif step == "wait":
            waiters.append(asyncio.create_task(event.wait()))
        elif step == "cancel":
            pending = [w for w in waiters if not w.done()]
            if pending:
                pending[0].cancel()
        await asyncio.sleep(0) if step == "turn" else None
        states = tuple(
            "cancelled" if w.cancelled() else w.result() if w.done() else "pending" for w in waiters
        )
        seen.append((step, event.is_set(), states))
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    return seen


@settings(max_examples=200, deadline=None)
@given(STEPS)
def test_a_light_event_answers_as_asyncio_event_does(steps: list[str]) -> None:
    theirs = asyncio.run(_observe(asyncio.Event(), steps))
    ours = asyncio.run(_observe(LightEvent(), steps))
    assert ours == theirs


def test_a_waiter_woken_then_cleared_still_returns_true() -> None:
    async def main() -> list[bool]:
        event = LightEvent()
        waiters = [asyncio.create_task(event.wait()) for _ in range(3)]
        await asyncio.sleep(0)
        event.set()
        event.clear()
        return await asyncio.gather(*waiters)

    assert asyncio.run(main()) == [True, True, True]
