"""New HTTP/2 streams are started a few per loop turn, one connection after another, so that one
client's burst does not hold back another client's first stream (transports/stream_starts.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from transports.stream_starts import PER_TURN, StreamStarts


def _recorder(begun: list[str], gone: frozenset[str] = frozenset()) -> Callable[[str], bool]:
    """A ``begin`` that records what it started; the ``gone`` streams (reset meanwhile) start nothing."""

    def begin(stream: str) -> bool:
        if stream in gone:
            return False
        begun.append(stream)
        return True

    return begin


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)  # one loop turn each


async def test_a_lone_stream_starts_at_once() -> None:
    starts = StreamStarts(asyncio.get_running_loop())
    begun: list[str] = []
    starts.start("a", _recorder(begun), "a1")
    assert begun == ["a1"] and starts.waiting == 0


async def test_a_burst_is_spread_over_turns_and_another_connection_goes_first() -> None:
    starts = StreamStarts(asyncio.get_running_loop())
    begun: list[str] = []
    for i in range(25):  # one read of connection a: 25 HEADERS
        starts.start("a", _recorder(begun), f"a{i}")
    starts.start("b", _recorder(begun), "b0")  # connection b's one stream, read in the same turn
    assert begun == ["a0", "b0"]  # one a connection this turn
    assert starts.waiting == 24
    per_turn = []
    while starts.waiting:
        before = len(begun)
        await _turns(1)
        per_turn.append(len(begun) - before)
    assert all(n <= PER_TURN for n in per_turn) and sum(per_turn) == 24
    assert begun == ["a0", "b0", *(f"a{i}" for i in range(1, 25))]  # a's own order kept


async def test_connections_take_turns_while_streams_wait() -> None:
    starts = StreamStarts(asyncio.get_running_loop(), per_turn=4)
    begun: list[str] = []
    for name in "abc":
        for i in range(5):
            starts.start(name, _recorder(begun), f"{name}{i}")
    assert begun == ["a0", "b0", "c0"]  # at once: one a connection
    await _turns(1)
    assert begun[3:] == ["a1", "b1", "c1", "a2"]  # then the turn's room, round robin
    await _turns(1)
    assert begun[7:] == ["b2", "c2", "a3", "b3"]
    await _turns(3)
    assert sorted(begun) == sorted(f"{n}{i}" for n in "abc" for i in range(5))
    for name in "abc":  # each connection's streams in the order they came
        mine = [s for s in begun if s[0] == name]
        assert mine == [f"{name}{i}" for i in range(5)]


async def test_after_a_burst_a_new_stream_starts_at_once_again() -> None:
    starts = StreamStarts(asyncio.get_running_loop(), per_turn=2)
    begun: list[str] = []
    for i in range(6):
        starts.start("a", _recorder(begun), f"a{i}")
    await _turns(5)
    assert len(begun) == 6 and starts.waiting == 0
    await _turns(1)  # a turn with nothing started: the room is back
    starts.start("b", _recorder(begun), "b0")
    assert begun[-1] == "b0"


async def test_streams_reset_while_they_waited_take_no_room() -> None:
    """A client that opens and resets streams faster than they start (Rapid Reset) does not make the
    gateway keep them queued: a reset stream starts nothing and costs the turn nothing."""
    starts = StreamStarts(asyncio.get_running_loop(), per_turn=2)
    begun: list[str] = []
    gone = frozenset(f"a{i}" for i in range(1, 40))
    begin = _recorder(begun, gone)
    for i in range(42):
        starts.start("a", begin, f"a{i}")
    assert begun == ["a0"]
    await _turns(1)
    assert begun == ["a0", "a40", "a41"] and starts.waiting == 0  # 39 resets drained in the same turn
