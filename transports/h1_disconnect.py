"""Learning at once that an HTTP/1.1 client left, under uvicorn.

uvicorn reports a lost client only by setting the request cycle's message event, which wakes
whoever awaits ``receive()``: a task step queued behind everything else the event loop has to do.
And it does so from ``connection_lost``, which uvloop runs a loop turn after the client's FIN
arrived. When hundreds of clients leave at once, under load, the pods heard of it tens of
milliseconds late. Two changes make it immediate:

- ``PromptH1Protocol`` reports the departure from ``eof_received``, inside the I/O callback that
  saw the FIN. (An HTTP/1.1 client that half-closes is treated as gone by uvicorn anyway: it does
  not keep half-open connections, so the transport closes right after.)
- ``trip_on_disconnect`` swaps the request cycle's message event for one that calls back when the
  departure is reported, so the relay can close the pod connection there and then.

The same function serves the gateway's own HTTP/2 and HTTP/3 listeners: their ``receive`` is bound
to a stream object (``transports.asgi_stream.AsgiStream``) that offers ``watch_disconnect(on_gone)``
and calls back from the protocol callback that saw RST_STREAM, STOP_SENDING, GOAWAY or the
connection's end. Callers need not know which server they run under.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mypy_extensions import mypyc_attr
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from transports.hangups import Pairing
from transports.light_event import LightEvent

logger = logging.getLogger("sluicegate.relay")


@mypyc_attr(native_class=False)  # compiled classes cannot subclass list
class _Pipeline(list):  # type: ignore[type-arg]
    """uvicorn's queue of pipelined requests (``appendleft``, ``pop`` and truth are all it uses) as a
    list: an empty list holds no block, where uvicorn's deque holds 64 slots for the connection's
    life (~0.75 KB), for requests that almost never come pipelined."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class PromptH1Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, reporting a client's departure as soon as its FIN arrives.

    It also keeps the connection's hang-up watch (``HangupWatcher.pair_connection``) from its first
    request to its end, instead of one per request, and holds ~1.5 KB less a connection (below)."""

    hangup_pairing: Pairing | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Two deques uvicorn keeps for the connection's life (64 slots each) and rarely uses: its
        # queue of pipelined requests, and its write flow control's event (waited on only while the
        # client's socket is over its high-water mark). Swapped for the same contracts without them,
        # only when they are what we know, so that another uvicorn keeps its own.
        if type(self.pipeline) is collections.deque and not self.pipeline:
            self.pipeline = _Pipeline()  # type: ignore[assignment]
        flow = self.flow
        event = getattr(flow, "_is_writable_event", None)
        if type(event) is asyncio.Event:
            writable = LightEvent()
            if event.is_set():
                writable.set()
            flow._is_writable_event = writable  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        pairing = self.hangup_pairing
        if pairing is not None:
            self.hangup_pairing = None
            pairing.release()
        super().connection_lost(exc)

    def eof_received(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            cycle.disconnected = True
            cycle.message_event.set()


class _Tripwire(LightEvent):
    """uvicorn's per-request message event, which also calls ``on_gone`` when the client is lost.
    A ``LightEvent``: it lives as long as the stream, and only a request body's reader waits on it."""

    __slots__ = ("_cycle", "_on_gone")

    def __init__(self, cycle: Any, on_gone: Callable[[], None]) -> None:
        super().__init__()
        self._cycle = cycle
        self._on_gone: Callable[[], None] | None = on_gone

    def set(self) -> None:
        super().set()
        on_gone = self._on_gone
        if on_gone is not None and self._cycle.disconnected:
            self._on_gone = None
            try:
                on_gone()
            except Exception:  # uvicorn's connection_lost must still finish its own clean-up
                logger.exception("disconnect callback failed")

    def disarm(self) -> None:
        # The cycle holds this event and this event the cycle: dropping the reference lets the
        # request's objects go when the request does, not at the collector's next pass.
        self._on_gone = None
        self._cycle = None


class Disarmable(Protocol):
    def disarm(self) -> None: ...


def trip_on_disconnect(
    receive: Callable[[], Awaitable[Any]], on_gone: Callable[[], None]
) -> Disarmable | None:
    """Call ``on_gone`` from the protocol's own I/O callback the moment the client goes away.

    Under uvicorn's HTTP/1.1 that is ``eof_received``/``connection_lost``; under the gateway's
    HTTP/2 and HTTP/3 listeners, the callback that saw the stream reset or the connection end
    (``receive.__self__.watch_disconnect``). Returns a hook (``disarm()`` it once the response is
    complete), or None when ``receive`` belongs to neither; then the caller must await
    ``receive()`` itself. Calls ``on_gone`` at once if the client has already left.
    """
    cycle: Any = getattr(receive, "__self__", None)
    event = getattr(cycle, "message_event", None)
    if type(event) is not asyncio.Event or not isinstance(getattr(cycle, "disconnected", None), bool):
        watch = getattr(cycle, "watch_disconnect", None)
        return watch(on_gone) if watch is not None else None
    wire = _Tripwire(cycle, on_gone)
    if event.is_set():
        LightEvent.set(wire)
    cycle.message_event = wire
    if cycle.disconnected:
        wire.set()
    return wire


def client_transport_of(receive: Callable[[], Awaitable[Any]]) -> Any | None:
    """The client connection's transport behind a uvicorn request cycle's ``receive``, else None
    (or None once it is closing)."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    if transport is None or transport.is_closing():
        return None
    return transport
