"""Timeouts of one delay sharing one loop timer: each runs at its own deadline, in the order set,
unless cancelled; a key set again starts over; one callback's failure spares the others."""

from __future__ import annotations

import asyncio
import types

from transports.h2_dispatch import CleartextDispatch
from transports.same_delay_timers import SameDelayTimers

DELAY = 0.05


def _fired(timers: SameDelayTimers, loop: asyncio.AbstractEventLoop, key: object) -> asyncio.Future[float]:
    """A future resolved with the loop time at which ``key``'s timeout ran."""
    done: asyncio.Future[float] = loop.create_future()
    timers.set(loop, key, lambda: done.set_result(loop.time()))
    return done


async def test_each_timeout_runs_at_its_own_deadline_in_order() -> None:
    loop = asyncio.get_running_loop()
    timers = SameDelayTimers(DELAY)
    set_at = []
    fired = []
    for key in ("a", "b", "c"):
        set_at.append(loop.time())
        fired.append(_fired(timers, loop, key))
        await asyncio.sleep(DELAY / 4)  # spaced set times, so each deadline is its own
    times = await asyncio.wait_for(asyncio.gather(*fired), 5)
    for began, ran in zip(set_at, times, strict=True):
        assert ran >= began + DELAY - 0.002  # never early (the loop's clock has 1 ms steps)
    assert times == sorted(times)
    assert timers.pending == 0


async def test_a_cancelled_timeout_never_runs_and_the_others_still_do() -> None:
    loop = asyncio.get_running_loop()
    timers = SameDelayTimers(DELAY)
    ran: list[str] = []
    timers.set(loop, "gone", lambda: ran.append("gone"))
    last = _fired(timers, loop, "kept")
    timers.cancel("gone")
    timers.cancel("never set")  # nothing
    await asyncio.wait_for(last, 5)
    assert ran == []


async def test_a_key_set_again_starts_over_with_its_new_callback() -> None:
    loop = asyncio.get_running_loop()
    timers = SameDelayTimers(DELAY)
    ran: list[tuple[str, float]] = []
    both = loop.create_future()

    def record(name: str) -> None:
        ran.append((name, loop.time()))
        if len(ran) == 2:
            both.set_result(None)

    timers.set(loop, "k", lambda: record("k, first"))
    await asyncio.sleep(DELAY / 4)
    other_at = loop.time()
    timers.set(loop, "other", lambda: record("other"))
    await asyncio.sleep(DELAY / 4)
    again_at = loop.time()
    timers.set(loop, "k", lambda: record("k, again"))  # replaces the first, behind "other"
    await asyncio.wait_for(both, 5)
    # in deadline order: "other" is not held back behind "k"'s new deadline
    assert [name for name, _ in ran] == ["other", "k, again"]
    assert ran[0][1] >= other_at + DELAY - 0.002
    assert ran[1][1] >= again_at + DELAY - 0.002


async def test_a_failing_callback_spares_the_others_and_is_reported() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        timers = SameDelayTimers(DELAY)
        timers.set(loop, "bad", lambda: 1 / 0)
        good = _fired(timers, loop, "good")
        await asyncio.wait_for(good, 5)
    finally:
        loop.set_exception_handler(None)
    assert [type(c["exception"]) for c in reported] == [ZeroDivisionError]


async def test_timeouts_set_and_cancelled_by_a_running_callback_keep_their_deadlines() -> None:
    """A callback that sets a new timeout (an idle connection parked again, say) must not move the
    deadline of those already waiting."""
    loop = asyncio.get_running_loop()
    timers = SameDelayTimers(DELAY)
    later = loop.create_future()
    chained = loop.create_future()

    def first() -> None:
        timers.set(loop, "chained", lambda: chained.set_result(loop.time()))
        timers.cancel("cancelled")

    timers.set(loop, "first", first)
    await asyncio.sleep(DELAY / 2)
    later_set = loop.time()
    timers.set(loop, "later", lambda: later.set_result(loop.time()))
    timers.set(loop, "cancelled", lambda: chained.set_exception(AssertionError("cancelled ran")))
    later_at = await asyncio.wait_for(later, 5)
    assert later_set + DELAY - 0.002 <= later_at < later_set + DELAY + 1.0
    chained_at = await asyncio.wait_for(chained, 5)
    assert chained_at > later_at


class _Connections(set):
    """uvicorn's set of live connections, telling a test when it changes."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def add(self, item: object) -> None:
        super().add(item)
        self.changed.set()

    def discard(self, item: object) -> None:
        super().discard(item)
        self.changed.set()

    async def until(self, count: int) -> None:
        while len(self) != count:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)


async def test_a_listeners_new_connections_wait_for_their_first_bytes_in_one_set_of_timeouts() -> None:
    """The cleartext listener hands each new connection the same timeouts (one loop timer for all of
    them, however many connect at once); a connection that goes away takes its timeout with it."""
    loop = asyncio.get_running_loop()
    timers = SameDelayTimers(30.0)
    state = types.SimpleNamespace(connections=_Connections())

    def factory() -> CleartextDispatch:
        return CleartextDispatch(None, state, {}, loop, first_bytes=timers)

    server = await loop.create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await state.connections.until(3)  # each dispatch has seen connection_made
        assert timers.pending == 3
        clients[0][1].close()
        await state.connections.until(2)  # that one's dispatch has seen connection_lost
        assert timers.pending == 2
        for _reader, writer in clients[1:]:
            writer.close()
    finally:
        server.close()
