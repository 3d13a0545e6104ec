"""``LightEvent``: ``asyncio.Event``'s contract without its deque until something waits.

``asyncio.Event`` makes its waiters' deque (a 64-slot block, ~0.75 KB) when it is made. uvicorn makes
two for every HTTP/1.1 stream that live as long as the stream (the connection's write flow control and
the request's message event), and while tokens flow nothing waits on either: at 2,000 streams they
held ~3 MB of the gateway's memory (tracemalloc). ``LightEvent`` keeps its waiters in a list made on
the first ``wait()``; ``set``, ``clear``, ``is_set`` and ``wait`` behave as ``asyncio.Event``'s (held
to them by tests/test_light_event.py).
"""

from __future__ import annotations

import asyncio


class LightEvent:
    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[bool]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        """Set the flag and wake every waiter (each one's future, as ``asyncio.Event`` does)."""
        if not self._value:
            self._value = True
            for waiter in self._waiters or ():
                if not waiter.done():
                    waiter.set_result(True)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> bool:
        """True once the flag is set; at once if it is."""
        if self._value:
            return True
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._waiters
        if waiters is None:
            waiters = self._waiters = []
        waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            waiters.remove(waiter)
