"""One HTTP/2 or HTTP/3 request stream as an ASGI ``http`` call: scope, ``receive``, ``send``.

The HTTP/2 and HTTP/3 listeners (``transports/h2_server.py``, ``transports/h3_server.py``) are
sans-IO state machines (h2, aioquic) driven by small asyncio protocols; everything they share about
running the app for one stream lives here. A connection hands each stream to an ``AsgiStream`` and
tells it what the peer did (``feed_body``, ``feed_end``, ``lost``, ``writable``); the stream calls
back into the connection (``StreamConnection``) to write headers and data.

The three promises the rest of the gateway relies on:

- **Disconnects are reported at once.** When the peer resets the stream or the connection goes,
  ``lost()`` runs inside the protocol callback that learned it: ``receive()`` returns
  ``http.disconnect``, a ``send()`` waiting for room wakes up and returns, and the callback the app
  registered through ``watch_disconnect`` (see ``transports/h1_disconnect.trip_on_disconnect``, used
  by the relay's ``DisconnectWatch``) runs right there, so the pod request can be closed without
  waiting for a task to be scheduled.
- **Back-pressure, bounded buffers.** ``send()`` hands the body to the connection, which writes what
  flow control allows; while the stream's window is closed or the connection's output is above its
  high-water mark, ``send()`` does not return. Nothing is queued beyond the one chunk in hand.
- **A client that stops reading is cut off.** Each wait for room is bounded by the stream's
  ``stall_s``: a peer that never opens its flow-control window (or never reads its socket) would
  otherwise hold ``send()``, and with it the pod's generation, forever. When the deadline passes,
  the connection resets the stream (``StreamConnection.stalled``, in its protocol's words) and the
  stream is ``lost()``: the app sees ``http.disconnect`` and the relay aborts the pod request.
- **After the response (or the client) is gone, sends are no-ops**, as under uvicorn; request body
  that arrives after the response is complete is not kept (the connection decides what to do with
  the rest of the upload, see ``stream_done``).

The hot path, one body chunk: a dict lookup or two, one call into the connection (which frames it
and schedules one write per connection per event-loop turn), no task, queue or copy of our own.
Where the connection supports it (HTTP/2 and HTTP/3: ``splices``), the relay skips even the ASGI ``send`` for
the body after the first token: ``splice_target()``/``writer()`` hand each pod chunk to the
connection from the pod's parser callback (``transports/client_socket.py``), with the same promises:
reading from the pod pauses while the connection keeps a chunk back, under the same ``stall_s``, and
stops when the stream is lost.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transports.client_socket import Sink, Upstream

logger = logging.getLogger("sluicegate.transports")

Headers = list[tuple[bytes, bytes]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

# Connection-specific headers are forbidden in HTTP/2 and HTTP/3 responses (RFC 9113 section
# 8.2.2, RFC 9114 section 4.2); an app written for HTTP/1.1 may still send them (the gateway's drain
# answer carries "connection: close"), so they are dropped rather than failing the response.
_BAD_NAME = re.compile(rb"[^a-z0-9!#$%&'*+\-.^_`|~]")  # after lower-casing; RFC 9110 token
_BAD_VALUE = re.compile(rb"[\x00\r\n]")  # RFC 9113 section 8.2.1, RFC 9114 section 4.2
_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"  # what _BAD_NAME lets through
# what _BAD_VALUE lets through: RFC 9113 8.2.1 field value bytes (h2_patches checks received ones)
FIELD_VALUE_BYTES = bytes(b for b in range(256) if b not in b"\x00\r\n")
_SPACE = b" \t"
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})


def response_headers(message: dict[str, Any]) -> Headers:
    """A response start's ``:status`` and headers as HTTP/2 and HTTP/3 carry them: names lower-case,
    no hop-by-hop fields, no spaces around a value; a name or value that would break the whole
    connection raises, as uvicorn's HTTP/1.1 does.

    The usual start (lower-case token names, values without NUL, CR or LF) is checked in one
    ``bytes.translate`` over all its names and one over all its values; two regular expressions and
    a ``lower()`` a header cost ~40 k instructions a request. Any other start takes the per-header
    way (``_checked_headers``), which lower-cases or says what is wrong."""
    headers = [(b":status", b"%d" % message["status"])]
    names = []
    values = []
    for name, value in message.get("headers", ()):
        names.append(name)
        values.append(value)
        if name not in _HOP_BY_HOP:
            headers.append((name, value.strip(_SPACE)))
    names_ok = not b"".join(names).translate(None, _TOKEN_BYTES) and b"" not in names
    if names_ok and not b"".join(values).translate(None, FIELD_VALUE_BYTES):
        return headers
    return _checked_headers(message)


def _checked_headers(message: dict[str, Any]) -> Headers:
    headers = [(b":status", b"%d" % message["status"])]
    for name, value in message.get("headers", ()):
        name = name.lower()
        if _BAD_NAME.search(name) or not name or _BAD_VALUE.search(value):
            # as uvicorn's HTTP/1.1 does; sent, it would break the whole connection
            raise RuntimeError(f"invalid HTTP response header {name!r}: {value!r}")
        if name not in _HOP_BY_HOP:
            if value[:1] in _SPACE or value[-1:] in _SPACE:  # not allowed around a value
                value = value.strip(_SPACE)
            headers.append((name, value))
    return headers


class StreamConnection(Protocol):
    """What an HTTP/2 or HTTP/3 connection does for its streams."""

    def send_headers(self, stream: AsgiStream, headers: Headers, end_stream: bool) -> None:
        """Write the response's HEADERS (``headers`` begins with ``:status``)."""

    def send_data(self, stream: AsgiStream, data: bytes, end_stream: bool) -> bool:
        """Write ``data`` as far as flow control allows and keep the rest (in order, after what the
        stream's earlier calls left; with ASGI sends that is at most this chunk, with a splice at
        most the rest of one pod read).

        True: go on. False: the caller waits until the connection calls ``stream.writable()`` (all
        of ``data`` is out and the connection's output is below its high-water mark) or
        ``stream.lost()``."""

    def consumed(self, stream: AsgiStream, size: int) -> None:
        """The app has read ``size`` flow-controlled bytes of the request body: open the window."""

    def abort(self, stream: AsgiStream) -> None:
        """Reset the stream (the app failed after the response started)."""

    def stalled(self, stream: AsgiStream) -> None:
        """Reset the stream: ``send()`` has waited ``stream.stall_s`` for room (the client does not
        read). The stream calls ``lost()`` itself right after."""

    def stream_done(self, stream: AsgiStream) -> None:
        """The app has returned: forget the stream."""


class DisconnectHook:
    """A registered on-disconnect callback; ``disarm()`` it once the response is complete."""

    __slots__ = ("_stream",)

    def __init__(self, stream: AsgiStream) -> None:
        self._stream: AsgiStream | None = stream

    def disarm(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.on_gone = None
            self._stream = None


class AsgiStream:
    """One request: the ASGI ``receive``/``send`` pair and the stream's state (see module doc)."""

    __slots__ = (
        "_body",
        "_body_done",
        "_delivered_end",
        "_rx_waiter",
        "_tx_waiter",
        "closed",
        "conn",
        "ended",
        "gone",
        "on_gone",
        "scope",
        "stall_s",
        "started",
        "stream_id",
        "task",
        "unconsumed",
    )

    def __init__(
        self, conn: StreamConnection, stream_id: int, scope: dict[str, Any], stall_s: float | None = None
    ) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.scope = scope
        self.stall_s = stall_s  # the longest one send() waits for room; None: no limit
        self.task: asyncio.Task[None] | None = None
        self.started = False  # response headers sent
        self.ended = False  # the last byte of the response handed to the connection
        self.gone = False  # the client reset the stream or the connection is lost
        self.closed = False  # ended or gone: sends are no-ops
        self.on_gone: Callable[[], None] | None = None
        self.unconsumed = 0  # flow-controlled request bytes received, not yet read by the app
        self._body: deque[tuple[bytes, int]] = deque()
        self._body_done = False  # the request's END_STREAM / FIN has arrived
        self._delivered_end = False  # receive() has returned more_body=False
        self._rx_waiter: asyncio.Event | None = None  # an Event: receive() may have several waiters
        self._tx_waiter: asyncio.Future[None] | None = None

    # -- told by the connection ------------------------------------------------------------------

    def feed_body(self, data: bytes, flow_size: int) -> None:
        if self.closed or self._delivered_end:
            # nobody will read it (the response is complete, or the client gone): give the window
            # back now and keep nothing
            self.conn.consumed(self, flow_size)
            return
        self._body.append((data, flow_size))
        self.unconsumed += flow_size
        self._notify_rx()

    def feed_end(self) -> None:
        self._body_done = True
        self._notify_rx()

    def lost(self) -> None:
        """The client reset the stream, or the connection is gone: tell everyone, now."""
        if self.gone:
            return
        self.gone = True
        was_closed, self.closed = self.closed, True
        self._notify_rx()
        _wake(self._tx_waiter)
        on_gone, self.on_gone = self.on_gone, None
        if on_gone is not None and not was_closed:
            try:
                on_gone()
            except Exception:  # the connection's own clean-up must still run
                logger.exception("disconnect callback failed")

    def writable(self) -> None:
        """The data of the last ``send_data`` is out and the connection has room again."""
        _wake(self._tx_waiter)

    # -- the relay's splice (transports/client_socket.py) -----------------------------------------

    def splice_target(self) -> AsgiStream | None:
        """This stream, when its connection takes spliced body chunks (HTTP/2, HTTP/3) and the response has
        started and is open; else None (a connection without ``splices``: ASGI sends)."""
        if self.started and not self.closed and getattr(self.conn, "splices", False):
            return self
        return None

    def writer(self, upstream: Upstream) -> Sink:
        """A sink for body chunks, called from the pod connection's parser callback: each goes to the
        connection as ``send()`` would hand it, without a task step. While the connection keeps some
        back (the client's window is short, or its socket over the high-water mark), reading from the
        pod pauses until there is room, or until ``stall_s`` resets the stream; the connection keeps
        chunks in order, so the ASGI ``send()`` that ends the response waits behind them."""
        send_data = self.conn.send_data
        paused = False

        def resume(_: asyncio.Future[None]) -> None:
            nonlocal paused
            paused = False
            if not self.gone:  # gone: the disconnect callback has closed the pod answer
                upstream.resume_reading()

        def sink(body: bytes) -> None:
            nonlocal paused
            if self.closed:  # the client left (its disconnect callback ends the request): stop the pod
                upstream.close()
                return
            if not send_data(self, body, False) and not paused:
                paused = True
                upstream.pause_reading()
                self._room().add_done_callback(resume)

        return sink

    @property
    def request_complete(self) -> bool:
        """The request's end (END_STREAM / FIN) has arrived."""
        return self._body_done

    # -- ASGI ------------------------------------------------------------------------------------

    def watch_disconnect(self, on_gone: Callable[[], None]) -> DisconnectHook:
        """Call ``on_gone`` from the protocol callback that learns the client left (at once if it
        already has). The relay's ``DisconnectWatch`` registers here through ``trip_on_disconnect``."""
        hook = DisconnectHook(self)
        if self.gone:
            on_gone()
        elif not self.ended:
            self.on_gone = on_gone
        return hook

    async def receive(self) -> dict[str, Any]:
        if not self._delivered_end and not self.closed:
            body = self._body
            while not body and not self._body_done and not self.closed:
                await self._wait_rx()
            if body:
                data, size = body.popleft()
                self.unconsumed -= size
                if size:
                    self.conn.consumed(self, size)
                more = bool(body) or not self._body_done
                self._delivered_end = not more
                return {"type": "http.request", "body": data, "more_body": more}
            if not self.closed:
                self._delivered_end = True
                return {"type": "http.request", "body": b"", "more_body": False}
        while not self.closed:
            await self._wait_rx()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.closed:
            return
        kind = message["type"]
        if kind == "http.response.body" and self.started:
            body = message.get("body", b"")
            if message.get("more_body", False):
                if body and not self.conn.send_data(self, body, False):
                    await self._wait_tx()
                return
            self.ended = True
            if not self.conn.send_data(self, body, True):
                await self._wait_tx()
            self._finish()
        elif kind == "http.response.start" and not self.started:
            headers = response_headers(message)
            self.started = True
            self.conn.send_headers(self, headers, False)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} at this point of the response")

    # -- running the app -------------------------------------------------------------------------

    async def run(self, app: ASGIApp) -> None:
        """The app for this stream, with uvicorn's rules for apps that fail or return early."""
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            if not self.closed:
                self.conn.abort(self)
        except Exception:
            logger.exception("exception in ASGI application")
            await self._fail()
        else:
            if not self.closed:
                logger.error("ASGI callable returned without %s the response",
                             "completing" if self.started else "starting")
                await self._fail()
        finally:
            self.closed = True
            self.on_gone = None
            self.conn.stream_done(self)

    async def _fail(self) -> None:
        if self.closed:
            return
        if self.started:
            self.conn.abort(self)
            self._finish()
            return
        await self.send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    def _finish(self) -> None:
        self.ended = True
        self.closed = True
        self.on_gone = None
        self._notify_rx()  # a pending receive() now returns http.disconnect, as under uvicorn

    def _notify_rx(self) -> None:
        if self._rx_waiter is not None:
            self._rx_waiter.set()

    async def _wait_rx(self) -> None:
        waiter = self._rx_waiter
        if waiter is None:
            waiter = self._rx_waiter = asyncio.Event()
        waiter.clear()  # callers re-check their condition after every wake-up
        await waiter.wait()

    async def _wait_tx(self) -> None:
        if self.gone:
            return
        await self._room()

    def _room(self) -> asyncio.Future[None]:
        """The wait for room (done on ``writable()`` or ``lost()``), shared by ``send()`` and the
        splice; the stream is reset if it lasts ``stall_s``. One timer per wait, none per chunk."""
        waiter = self._tx_waiter
        if waiter is not None and not waiter.done():
            return waiter
        loop = asyncio.get_running_loop()
        waiter = self._tx_waiter = loop.create_future()
        if self.stall_s is not None:
            timer = loop.call_later(self.stall_s, self._stalled, waiter)
            waiter.add_done_callback(lambda _: timer.cancel())
        return waiter

    def _stalled(self, waiter: asyncio.Future[None]) -> None:
        """The stall deadline passed with ``send()`` still waiting: the client is not reading."""
        if waiter.done() or self.gone:
            return
        logger.info("stream %d: no room to send for %.3g s, resetting it", self.stream_id, self.stall_s)
        try:
            self.conn.stalled(self)
        finally:
            self.lost()  # http.disconnect, the relay's callback (the pod is aborted), send() returns


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def request_scope(
    *,
    http_version: str,
    scheme: str,
    headers: Headers,
    server: tuple[str, int] | None,
    client: tuple[str, int] | None,
    root_path: str = "",
    state: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ASGI ``http`` scope for a request's header block (pseudo-headers included), or None
    when it lacks ``:method`` or ``:path`` (the caller resets the stream)."""
    method = path = authority = None
    regular: Headers = []
    for name, value in headers:
        if name[:1] == b":":
            if name == b":method":
                method = value
            elif name == b":path":
                path = value
            elif name == b":authority":
                authority = value
            # :scheme is the client's view; the scope's scheme is the listener's (TLS or not)
        else:
            regular.append((name.lower(), value))
    if method is None or path is None:
        return None
    if authority is not None and not any(name == b"host" for name, _ in regular):
        regular.insert(0, (b"host", authority))
    raw_path, _, query = path.partition(b"?")
    decoded = raw_path.decode("latin-1")
    if "%" in decoded:
        decoded = urllib.parse.unquote(decoded)
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": http_version,
        "method": method.decode("latin-1"),
        "scheme": scheme,
        "path": root_path + decoded,
        "raw_path": root_path.encode() + raw_path,
        "query_string": query,
        "root_path": root_path,
        "headers": regular,
        "server": server,
        "client": client,
        "state": dict(state) if state else {},
        "extensions": {},
    }


def peer_address(addr: Any) -> tuple[str, int] | None:
    """(host, port) from a socket address (IPv4 or IPv6 tuple), else None."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return str(addr[0]), int(addr[1])
    return None


def start_task(stream: AsgiStream, app: ASGIApp, tasks: set[asyncio.Task[None]]) -> bool:
    """``StreamStarts``' begin for HTTP/2 and HTTP/3 (``transports/stream_starts.py``): the app's
    task for ``stream``, kept in ``tasks`` (the server's, for shutdown) until it ends. False, and the
    stream forgotten, when the client cancelled it while it waited its turn."""
    if stream.gone:
        stream.conn.stream_done(stream)
        return False
    task = asyncio.get_running_loop().create_task(_serve(stream, app))
    stream.task = task
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return True


async def _serve(stream: AsgiStream, app: ASGIApp) -> None:
    """The app for one stream, unless the client cancelled it before the task's first step (its
    HEADERS and their reset in one read: HTTP/2's Rapid Reset): then the pod never hears of it."""
    if stream.gone:
        stream.conn.stream_done(stream)
        return
    await stream.run(app)
