"""Timeouts of one delay sharing one loop timer: each runs at its own deadline, in the order set,
unless cancelled; a key set again starts over; one callback's failure spares the others."""

from __future__ import annotations

import asyncio
import types

from transports.h2_dispatch import CleartextDispatch
from transports.same_delay_timers import FAILED, OrderedTimers, SameDelayTimers

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


async def test_a_time_set_after_a_later_one_was_cancelled_still_runs_at_its_own_time() -> None:
    """A cancelled timeout leaves the loop timer armed for its time. ``OrderedTimers`` takes an
    earlier time once none is pending (a request with a shorter budget after one with a longer):
    it must not wait for that stale timer."""
    loop = asyncio.get_running_loop()
    timers = OrderedTimers()
    assert timers.set_at(loop, "long budget", loop.time() + 30.0, lambda: None)
    timers.cancel("long budget")
    done: asyncio.Future[float] = loop.create_future()
    due = loop.time() + DELAY
    assert timers.set_at(loop, "short budget", due, lambda: done.set_result(loop.time()))
    ran = await asyncio.wait_for(done, 5)
    assert due - 0.002 <= ran < due + 1.0


class FakeLoop:
    """The three things the timeouts ask of a loop, on a clock a test moves by hand. ``early``: how
    much before its time each timer runs (uvloop rounds delays to its millisecond clock)."""

    def __init__(self, early: float = 0.0) -> None:
        self.now = 0.0
        self.early = early
        self.armed: list[tuple[float, object]] = []  # every call_at, in order
        self.reported: list[dict] = []
        self._pending: list[tuple[float, int, object]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback) -> object:
        self.armed.append((when, callback))
        self._pending.append((when - self.early, len(self.armed), callback))
        return object()  # a handle (never cancelled by the timeouts)

    def call_exception_handler(self, context: dict) -> None:
        self.reported.append(context)

    def run_until(self, until: float) -> None:
        """Run the timers due by ``until`` in time order, the clock at each one's time."""
        for _ in range(1000):  # a timer armed again and again without the clock moving: a failure
            due = sorted(t for t in self._pending if t[0] <= until)
            if not due:
                break
            self._pending.remove(due[0])
            self.now = max(self.now, due[0][0])
            due[0][2]()
        else:
            raise AssertionError("loop timers keep being armed at a time already reached")
        self.now = until


def test_each_timeout_runs_exactly_at_its_deadline_with_one_loop_timer_armed_at_a_time() -> None:
    loop = FakeLoop()
    timers = SameDelayTimers(10.0)
    ran: list[tuple[str, float]] = []
    for at, key in ((0.0, "a"), (1.0, "b"), (2.5, "c")):
        loop.run_until(at)
        timers.set(loop, key, lambda key=key: ran.append((key, loop.time())))
    loop.run_until(100.0)
    assert ran == [("a", 10.0), ("b", 11.0), ("c", 12.5)]
    assert [when for when, _ in loop.armed] == [10.0, 11.0, 12.5]  # one at a time, each at the next due


def test_times_set_in_order_run_at_their_times_and_one_earlier_than_a_pending_one_is_refused() -> None:
    """``OrderedTimers`` takes deadlines as times, in the order they fall due: one earlier than a
    pending one is refused, and nothing of it is set; once none is pending, any time is taken."""
    loop = FakeLoop()
    timers = OrderedTimers()
    ran: list[tuple[str, float]] = []

    def at(key: str, when: float) -> bool:
        return timers.set_at(loop, key, when, lambda: ran.append((key, loop.time())))

    assert at("a", 10.0) and at("b", 10.0) and at("c", 12.0)
    assert not at("early", 11.0)
    assert timers.pending == 3
    loop.run_until(100.0)
    assert ran == [("a", 10.0), ("b", 10.0), ("c", 12.0)]
    assert [when for when, _ in loop.armed] == [10.0, 12.0]
    assert at("after", 11.0)  # refused before, while "c" was pending; already past, so it runs at once
    loop.run_until(200.0)
    assert ran[-1] == ("after", 100.0)


def test_timeouts_set_and_cancelled_by_a_running_callback_keep_their_deadlines() -> None:
    """A callback that sets a timeout (an idle connection parked again, say) or cancels one must not
    move the deadlines of those already waiting, nor arm a loop timer of its own."""
    loop = FakeLoop()
    timers = SameDelayTimers(10.0)
    ran: list[tuple[str, float]] = []

    def first() -> None:
        ran.append(("first", loop.time()))
        timers.set(loop, "chained", lambda: ran.append(("chained", loop.time())))
        timers.cancel("cancelled")

    timers.set(loop, "first", first)
    loop.run_until(5.0)
    timers.set(loop, "later", lambda: ran.append(("later", loop.time())))
    timers.set(loop, "cancelled", lambda: ran.append(("cancelled", loop.time())))
    loop.run_until(100.0)
    assert ran == [("first", 10.0), ("later", 15.0), ("chained", 20.0)]
    assert [when for when, _ in loop.armed] == [10.0, 15.0, 20.0]


def test_a_timeout_cancelled_or_set_again_by_one_due_with_it_does_not_run_then() -> None:
    loop = FakeLoop()
    timers = SameDelayTimers(10.0)
    ran: list[tuple[str, float]] = []

    def first() -> None:
        ran.append(("first", loop.time()))
        timers.cancel("cancelled")
        timers.set(loop, "again", lambda: ran.append(("again, set again", loop.time())))

    timers.set(loop, "first", first)
    timers.set(loop, "cancelled", lambda: ran.append(("cancelled", loop.time())))
    timers.set(loop, "again", lambda: ran.append(("again", loop.time())))
    loop.run_until(100.0)
    assert ran == [("first", 10.0), ("again, set again", 20.0)]


def test_a_loop_timer_that_runs_a_hair_early_finds_its_timeout_due() -> None:
    """uvloop's clock has millisecond steps: a timer may run just before its time. The timeout runs
    then, instead of the loop timer being armed again and again until the clock moves on."""
    loop = FakeLoop(early=0.0004)
    timers = SameDelayTimers(0.3)
    ran: list[float] = []
    loop.run_until(0.1234)
    timers.set(loop, "k", lambda: ran.append(loop.time()))
    loop.run_until(10.0)
    assert len(ran) == 1 and 0.4234 - 0.001 <= ran[0] <= 0.4234
    assert len(loop.armed) == 1


def test_a_failing_callback_spares_the_others_and_is_reported() -> None:
    loop = FakeLoop()
    timers = SameDelayTimers(1.0)
    ran: list[str] = []
    timers.set(loop, "bad", lambda: 1 / 0)
    timers.set(loop, "good", lambda: ran.append("good"))
    loop.run_until(5.0)
    assert ran == ["good"]
    assert [(c["message"], type(c["exception"])) for c in loop.reported] == [(FAILED, ZeroDivisionError)]


def test_many_timeouts_due_at_once_all_run_in_one_pass_in_order() -> None:
    """A burst of connections that all time out together (a reconnect storm, a slowloris burst)."""
    loop = FakeLoop()
    timers = SameDelayTimers(1.0)
    ran: list[int] = []
    for key in range(20_000):
        timers.set(loop, key, lambda key=key: ran.append(key))
    for key in range(0, 20_000, 2):
        timers.cancel(key)
    loop.run_until(5.0)
    assert ran == list(range(1, 20_000, 2))
    assert len(loop.armed) == 1 and timers.pending == 0


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
