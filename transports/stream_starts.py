"""New streams started a few per event-loop turn, taking connections in turn.

One read of an HTTP/2 connection (or one QUIC datagram) can carry dozens of HEADERS frames, and one
loop turn can read several connections. Started as they come, every stream's admission (key, quota,
pick, the pod request: ~0.1 ms each on a quiet core) runs before the loop looks at a socket again,
first all of the first connection's, then all of the second's: the last connection's first stream
waits for every stream before it, and no answer is relayed until the whole burst has been admitted.

``StreamStarts`` (one per event loop, shared by its connections) starts at most one stream per
connection and ``per_turn`` in all in a loop turn, and queues the rest per connection, to be started
on the turns after, one connection after another. Between two turns the loop polls its sockets, so
the first answers are relayed while later streams are still being admitted, and a client that opens
25 streams at once does not hold back another client's first one. A lone stream starts at once;
under a steady load the price is one scheduled callback a loop turn. Nothing is refused, a
connection's own streams keep their order, and the stream caps (which count queued streams as
open) are unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Callable, Hashable
from typing import Any

PER_TURN = 8  # streams whose first step may run in one loop turn (~0.8 ms of admissions)

Begin = Callable[[Any], bool]  # starts the stream; False when there was nothing to start (reset meanwhile)

_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamStarts] = weakref.WeakKeyDictionary()


class StreamStarts:
    """Starts streams at most ``per_turn`` a loop turn and one a connection a turn; the rest in turn."""

    __slots__ = ("_budget", "_loop", "_per_turn", "_started", "_turn", "_waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, per_turn: int = PER_TURN) -> None:
        self._loop = loop
        self._per_turn = per_turn
        self._budget = per_turn
        self._started: set[Hashable] = set()  # connections that started a stream this turn
        # per connection, its streams waiting, in order; the connections in the order they are served
        self._waiting: collections.OrderedDict[Hashable, collections.deque[tuple[Begin, Any]]] = (
            collections.OrderedDict()
        )
        self._turn: asyncio.Handle | None = None

    @property
    def waiting(self) -> int:
        """Streams queued for a later turn."""
        return sum(len(queue) for queue in self._waiting.values())

    def start(self, connection: Hashable, begin: Begin, stream: Any) -> None:
        """``begin(stream)`` now if this turn has room for it, else on a later turn (see ``Begin``)."""
        if self._turn is None:
            self._turn = self._loop.call_soon(self._next_turn)
        queue = self._waiting.get(connection)
        if queue is None and self._budget and connection not in self._started:
            self._budget -= 1
            self._started.add(connection)
            begin(stream)
            return
        if queue is None:
            queue = self._waiting[connection] = collections.deque()
        queue.append((begin, stream))

    def _next_turn(self) -> None:
        self._turn = None
        self._started.clear()
        budget = self._per_turn
        waiting = self._waiting
        while waiting and budget:
            connection, queue = next(iter(waiting.items()))
            begin, stream = queue.popleft()
            if queue:
                waiting.move_to_end(connection)  # its next stream after every other connection's
            else:
                del waiting[connection]
            if begin(stream):  # a stream reset while it waited costs no room: a reset flood drains at once
                budget -= 1
        self._budget = budget
        if waiting or budget < self._per_turn:  # room again next turn, or more to start
            self._turn = self._loop.call_soon(self._next_turn)


def stream_starts(loop: asyncio.AbstractEventLoop) -> StreamStarts:
    """The loop's one ``StreamStarts``, shared by every connection and listener on it."""
    starts = _by_loop.get(loop)
    if starts is None:
        starts = _by_loop[loop] = StreamStarts(loop)
    return starts
