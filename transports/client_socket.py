"""Direct writes to an HTTP/1.1 client's socket, under uvicorn, for the relay's splice.

uvicorn's HTTP/1.1 ``send`` is a bound method of its request cycle, which holds the client's
transport and flow control. Once the status line is out (via ASGI, so uvicorn knows the response is
chunked), the body can be written to that transport in chunked framing straight from the pod
connection's parser callback, and the response still ends with an ordinary ASGI send. Anything that
is not uvicorn's HTTP/1.1 (HTTP/2, HTTP/3, another server) gets None and the relay uses ASGI sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol


class _Reader(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...


class ClientSocket:
    """The client's transport and uvicorn's flow control for one response."""

    __slots__ = ("flow", "transport")

    def __init__(self, transport: asyncio.Transport, flow: Any) -> None:
        self.transport = transport
        self.flow = flow

    def writer(self, upstream: _Reader) -> Callable[[bytes], None]:
        """A sink for body chunks: frame, write, and pause ``upstream`` while the client is slow."""
        transport = self.transport
        write = transport.write
        is_closing = transport.is_closing
        flow = self.flow
        drain: asyncio.Task[None] | None = None

        async def resume_when_drained() -> None:
            nonlocal drain
            await flow.drain()  # uvicorn also releases this when the client disconnects
            drain = None
            upstream.resume_reading()

        def sink(body: bytes) -> None:
            nonlocal drain
            if is_closing():
                # The client left; the disconnect watch ends the request. Stop reading the pod now.
                upstream.close()
                return
            write(b"%x\r\n%b\r\n" % (len(body), body))
            if flow.write_paused and drain is None:
                upstream.pause_reading()
                drain = asyncio.ensure_future(resume_when_drained())

        return sink


def client_socket(send: Callable[[dict[str, Any]], Awaitable[None]]) -> ClientSocket | None:
    """The client socket behind uvicorn's HTTP/1.1 ``send`` once a chunked response has started."""
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    flow = getattr(cycle, "flow", None)
    if transport is None or flow is None or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    return ClientSocket(transport, flow)
