"""A lean HTTP/1.1 client for pods that can splice a streaming body straight to the client socket.

Why not aiohttp on the hot path: measured at 100 concurrent streams on this machine, relaying one
aiohttp ``readany()`` per ASGI ``send`` costs ~36 CPU-ms per 1000 tokens, most of it a future
wake-up, a task step and the ASGI send machinery for every chunk. Here the pod's socket is parsed by
httptools (the same C parser uvicorn uses) and, once the first token has been seen, each body chunk
is written to the client's transport from the parser callback itself: no task wakes up per token.
Flow control still holds end to end: when the client's socket buffer fills, reading from the pod
pauses until it drains.

Connections are kept alive and reused per pod. A request that fails on a reused connection before
any response byte arrived is retried once on a fresh connection (the pod had closed it while idle).
"""

from __future__ import annotations

import asyncio
import collections
import os
import ssl
from typing import ClassVar

import httptools
from mypy_extensions import mypyc_attr

from transports.client_socket import Sink
from transports.hangups import shut_down_fd
from transports.same_delay_timers import SameDelayTimers
from transports.sse import EVENT_ENDS
from transports.tls import tls_reason

Key = tuple[str, int, ssl.SSLContext | None, str | None]  # host, port, TLS context, name checked


@mypyc_attr(native_class=False)
class PodConnectError(ConnectionError):
    """The pod could not be reached (refused, unreachable, or the connect timed out)."""


@mypyc_attr(native_class=False)
class PodConnectTimeout(PodConnectError):
    """The pod did not accept the connection within the connect timeout."""


@mypyc_attr(native_class=False)
class PodBrokenError(ConnectionError):
    """The pod's connection broke, or it sent bytes that are not HTTP, before the answer ended."""


@mypyc_attr(native_class=False)
class PodStalledError(PodBrokenError):
    """The pod went silent for longer than the stall timeout mid-answer (the gateway closed it)."""


@mypyc_attr(native_class=False)
class PodLineTooLong(PodBrokenError):
    """The pod sent more than ``max_line`` bytes without a newline (the gateway closed it)."""


NO_LIMIT = 1 << 62
_TAIL_BYTES = 64 * 1024  # how much of a stream's end is kept across reads split inside an event


class PodResponse:
    """One response from a pod: status and headers, then the body, read or spliced.

    Body chunks are queued until the caller either reads them (``read``/``read_all``) or hands
    the response a writer (``splice``), after which every chunk goes straight to that writer.
    """

    __slots__ = (
        "_chunks", "_conn", "_eof", "_error", "_now", "_waiter", "chunks", "done", "headers", "last",
        "last_at", "line", "max_line", "previous", "sink", "status",
    )

    def __init__(self, conn: PodConnection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] | tuple[()] = collections.deque()  # () once spliced
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self.sink: Sink | None = None
        self.done: asyncio.Future[None] = conn.loop.create_future()
        self.chunks = 0
        self.previous = b""
        self.last = b""
        self._now = conn.loop.time
        self.last_at = self._now()  # the last body chunk that was not a comment (or the headers)
        self.line = 0  # bytes since the body's last newline
        self.max_line = NO_LIMIT  # more than this without a newline ends the answer (SSE streams)

    # -- fed by the connection -------------------------------------------------------------------

    def _feed(self, body: bytes) -> None:
        if self._eof:
            return  # closed by the gateway while the parser was still delivering this read
        # a read of only SSE comments (b":...") is no progress; find, not ``in`` (see UsageTap.wrap)
        if body[0] != 58 or body.find(b"\ndata:") != -1:
            self.last_at = self._now()
        self.chunks += 1
        # ``previous + last`` must hold the stream's last whole event for the end-of-stream verdict:
        # a read that stopped inside an event is kept with the ones before it (rare, and bounded).
        # A token's read ends with LF LF: a slice's compare answers first (``endswith`` parses its
        # arguments: ~200 instructions a read more).
        last = self.last
        ended = last[-2:] == b"\n\n" or last.endswith(EVENT_ENDS)
        if ended or len(self.previous) > _TAIL_BYTES or self.max_line == NO_LIMIT:
            self.previous = last
        else:
            self.previous += last
        self.last = body
        # An endless line (or one huge event) ends the answer: the bytes since the last newline are
        # counted with one rfind, and only for a read that does not end with one (a token's does).
        if body[-1] != 10:
            newline = body.rfind(b"\n")
            if newline == -1:
                self.line += len(body)
                if self.line > self.max_line:
                    self.close(PodLineTooLong(f"more than {self.max_line} bytes without a newline"))
                    return
            else:
                self.line = len(body) - newline - 1
        elif self.line:
            self.line = 0
        sink = self.sink
        if sink is not None:
            sink(body)
            return
        self._chunks.append(body)  # type: ignore[union-attr]  # a deque again: not spliced
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._eof:
            return
        self._eof = True
        self._error = error
        self._wake()
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
                self.done.exception()  # mark retrieved: the caller may be gone

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- used by the relay -----------------------------------------------------------------------

    async def read(self) -> bytes:
        """The next body chunk, or b"" at the end; raises PodBrokenError if the answer broke."""
        while not self._chunks:
            if self._eof:
                if self._error is not None:
                    raise self._error
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._chunks.popleft()

    async def read_all(self, limit: int | None = None) -> bytes:
        """The whole body (or its first ``limit`` bytes, closing the connection after)."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read():
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size >= limit:
                self.close()
                break
        return b"".join(parts)[:limit]

    def splice(self, writer: Sink) -> None:
        """From now on every body chunk goes straight to ``writer``; queued ones first. The queue
        goes too (an empty deque keeps a 64-slot block, held for as long as the stream runs)."""
        chunks = self._chunks
        while chunks:
            writer(chunks.popleft())
        self._chunks = ()
        self.sink = writer

    def unsplice(self) -> None:
        """Stop handing chunks to the writer, and let go of it (chunks queue again, unread). A writer
        usually holds this response (to pause it), so keeping it would make every stream a cycle
        that only the garbage collector frees."""
        self.sink = None
        if not self._chunks:
            self._chunks = collections.deque()

    def pause_reading(self) -> None:
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    @property
    def complete(self) -> bool:
        return self._eof and self._error is None

    @property
    def socket(self) -> object | None:
        """The pod connection's socket (uvloop's view of it), for the hang-up watcher."""
        transport = self._conn.transport
        return transport.get_extra_info("socket") if transport is not None else None

    def lend_watch_fd(self) -> int:
        """The connection's kept copy of its socket for the hang-up watch (-1: none yet)."""
        return self._conn.lend_watch_fd()

    def keep_watch_fd(self, fd: int) -> None:
        """Give the hang-up watch's copy of the socket back to the connection (see ``PodConnection``)."""
        self._conn.keep_watch_fd(fd)

    def close(self, error: BaseException | None = None) -> None:
        """Abandon the answer: close the connection (a pod aborts the generation on this)."""
        self._conn.abort()
        self._finish(error or PodBrokenError("closed by the gateway"))

    def release(self) -> None:
        """Give a fully read connection back to the pool, else close it."""
        if self.complete:
            self._conn.release()
        else:
            self.close()


class PodConnection(asyncio.Protocol):
    """One keep-alive connection to a pod, parsed by httptools.

    Each response gets a parser of its own (``send_request``), made with the response's ``_feed``
    as its body callback: httptools binds its callbacks when a parser is made, and so every body
    read goes from the parser to the response with no call between (one Python call fewer on every
    token, for ~0.6 µs a request). That parser refers to the response, which refers back to the
    connection, so the connection lets go of both once the answer is over (``_drop_parser``): when it
    goes idle and when it closes. Bytes from the pod while no response is awaited, in a later read or
    after the answer's end in the same one, are not HTTP we asked for: the connection is closed, as
    nginx closes a cached upstream connection that reads anything."""

    def __init__(self, pool: PodClient, key: Key) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None  # the awaited response's
        self.on_body: Sink = _no_body  # the body callback a parser is made with: the response's ``_feed``
        self.response: PodResponse | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        self.used = 0
        self.got_bytes = False
        self.closed = False
        self._header_list: list[tuple[bytes, bytes]] = []
        # A copy of the socket's descriptor that the hang-up watch shuts down when a client leaves
        # (transports/hangups.py): lent to each request's watch and given back at its end, so a
        # request on a pooled connection makes no ``dup`` and no ``close`` of its own. Owned here
        # only while no watch holds it; closed with the connection.
        self.watch_fd = -1

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.response is None:  # unasked for: an idle connection, or one whose answer has ended
            self.abort()
            return
        try:
            self.parser.feed_data(data)  # type: ignore[union-attr]  # set with the response
        except httptools.HttpParserError as exc:
            self._fail(PodBrokenError(f"pod sent invalid HTTP: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._close_watch_fd()
        self._drop_parser()  # never inside ``feed_data``: the transport calls this on a later turn
        self.pool._forget(self)
        response = self.response
        if exc is None and response is not None and response.status and _until_close(response.headers):
            # A body with neither length nor chunks ends where the connection does (RFC 9112 6.3):
            # the EOF completes it, and whether the answer was whole is the relay's verdict.
            self.response = None
            response._finish()
            return
        if self.key[2] is not None and self.used == 1 and not self.got_bytes:
            # A pod that wants a client certificate (or refuses ours) checks it after TLS 1.3's
            # handshake has completed on our side: all we see is the connection closing unanswered.
            why = _tls_why(exc)
            self._fail(PodBrokenError(f"the pod closed the TLS connection without answering ({why})"))
            return
        self._fail(PodBrokenError(f"connection closed by the pod ({exc or 'EOF'})"))

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.response is None:  # a second message after the answer, in the same read
            raise httptools.HttpParserError("a response nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:
            return
        response.status = self.parser.get_status_code()  # type: ignore[union-attr]
        response.headers = {
            n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._header_list
        }
        self._header_list = []
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_result(None)

    def on_message_complete(self) -> None:
        response = self.response
        self.response = None
        keep = self.parser.should_keep_alive()  # type: ignore[union-attr]
        if response is not None:
            response._finish()
        if not keep:
            self.abort()

    # -- connection life -------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(error)
        response = self.response
        self.response = None
        if response is not None:
            response._finish(error)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        self.pool._forget(self)
        transport = self.transport
        if transport is not None:
            if not transport.is_closing():  # once: a second abort, or one after the pod hung up, skips it
                shut_down_now(transport)
            transport.abort()
        self._close_watch_fd()

    def lend_watch_fd(self) -> int:
        fd, self.watch_fd = self.watch_fd, -1
        return fd

    def keep_watch_fd(self, fd: int) -> None:
        if fd < 0:
            return
        if self.closed or self.watch_fd >= 0:
            os.close(fd)
        else:
            self.watch_fd = fd

    def _close_watch_fd(self) -> None:
        if self.watch_fd >= 0:
            os.close(self.watch_fd)
            self.watch_fd = -1

    def release(self) -> None:
        if self.closed or self.response is not None:
            return
        self._drop_parser()
        self.pool._park(self)

    def _drop_parser(self) -> None:
        """Let go of the parser and the response whose ``_feed`` it calls (a cycle through this)."""
        self.parser = None
        self.on_body = _no_body

    def send_request(self, head: bytes, body: bytes) -> PodResponse:
        assert self.transport is not None
        self.used += 1
        self.got_bytes = False
        self.response = response = PodResponse(self)
        self.on_body = response._feed
        self.parser = httptools.HttpResponseParser(self)
        self.headers_ready = self.loop.create_future()
        self.transport.write(head + body)
        return response


class PodClient:
    """A pool of keep-alive connections to pods (one per process, shared by all requests)."""

    def __init__(
        self, connect_timeout_s: float, keepalive_timeout_s: float, max_idle_per_pod: int = 512
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_idle_per_pod = max_idle_per_pod
        self._idle: dict[Key, list[PodConnection]] = {}
        self._open: set[PodConnection] = set()
        # each idle connection's keep-alive: one shared loop timer, not one set and cancelled a request
        self._idle_timeouts = SameDelayTimers(keepalive_timeout_s)
        self._stall_timeouts: dict[float, SameDelayTimers] = {}  # StallWatch's first looks, by delay

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def stall_timeouts(self, stall_s: float) -> SameDelayTimers:
        """The shared timeouts of ``stall_s`` for streams' stall watches (``StallWatch``)."""
        timers = self._stall_timeouts.get(stall_s)
        if timers is None:
            timers = self._stall_timeouts[stall_s] = SameDelayTimers(stall_s)
        return timers

    async def request(
        self,
        host: str,
        port: int,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        tls: ssl.SSLContext | None = None,
        connect_timeout_s: float | None = None,
        server_hostname: str | None = None,
    ) -> PodResponse:
        """Send a POST and wait for the response's status and headers.

        ``tls``: the context for an https:// pod (None: plain TCP); the certificate must name
        ``server_hostname`` (default: ``host``). Connections are pooled per host, port and both.
        """
        head = _request_head(host, port, path, headers, len(body))
        key = (host, port, tls, (server_hostname or host) if tls else None)
        conn = self._take_idle(key)
        if conn is not None:
            try:
                return await self._exchange(conn, head, body)
            except PodBrokenError:
                if conn.got_bytes:
                    raise
                # The pod closed this idle connection as we reused it: once more, fresh.
        conn = await self._connect(key, connect_timeout_s or self.connect_timeout_s)
        return await self._exchange(conn, head, body)

    async def _exchange(self, conn: PodConnection, head: bytes, body: bytes) -> PodResponse:
        response = conn.send_request(head, body)
        assert conn.headers_ready is not None
        try:
            await conn.headers_ready
        except asyncio.CancelledError:
            conn.abort()
            raise
        return response

    async def _connect(self, key: Key, timeout_s: float) -> PodConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: PodConnection(self, key), key[0], key[1], ssl=key[2], server_hostname=key[3]
                )
        except TimeoutError:
            raise PodConnectTimeout(f"connect to {key[0]}:{key[1]} timed out after {timeout_s:g} s") from None
        except ssl.SSLError as tls_error:  # (one name per type: compiled, a name has one type)
            raise PodConnectError(f"TLS handshake failed: {tls_reason(tls_error)}") from None
        except OSError as exc:
            raise PodConnectError(exc.strerror or str(exc)) from None
        self._open.add(conn)
        return conn

    def _take_idle(self, key: Key) -> PodConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            self._idle_timeouts.cancel(conn)
            if not conn.closed:
                return conn
        return None

    def _park(self, conn: PodConnection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_pod:
            conn.abort()
            return
        idle.append(conn)
        self._idle_timeouts.set(conn.loop, conn, conn.abort)

    def _forget(self, conn: PodConnection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        self._idle_timeouts.cancel(conn)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.abort()


def _no_body(body: bytes) -> None:
    """The body callback in place while no answer is awaited (no parser is made with it)."""


def shut_down_now(transport: asyncio.BaseTransport) -> None:
    """Send the peer its EOF now, not when the event loop gets round to closing the socket.

    uvloop's ``abort()`` closes the socket in a later loop callback; when a thousand clients leave
    at once, that callback queues behind every other request's clean-up and the pod learns of the
    abort ~100 ms late. A ``shutdown()`` on the socket itself reaches the pod at once.
    """
    sock = transport.get_extra_info("socket")
    fd = sock.fileno() if sock is not None else -1
    if fd >= 0:
        shut_down_fd(fd)


def _tls_why(exc: Exception | None) -> str:
    if isinstance(exc, ssl.SSLError):
        return tls_reason(exc)
    return "did it want a client certificate, or refuse ours? see upstream.tls.client_cert"


def _until_close(headers: dict[str, str]) -> bool:
    """Whether a response's body is delimited by the connection's close (no length, not chunked)."""
    return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower()


def _request_head(
    host: str, port: int, path: str, headers: list[tuple[bytes, bytes]], length: int
) -> bytes:
    lines = [b"POST %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-length: %d\r\n" % (
        path.encode(), host.encode(), port, length
    )]
    for name, value in headers:
        lines.append(name + b": " + value + b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


class StallWatch:
    """Ends an answer whose pod has been silent longer than ``stall_s``.

    The per-token path only records the time of each chunk. The first look comes ``stall_s`` after
    the watch starts, from the pool's timeouts of that delay (one loop timer shared by every stream:
    most streams end before it), when the pod's last bytes are recent enough that it comes at most
    ``FIRST_LOOK_LATE`` of ``stall_s`` late; a stream still running then, or a watch started long
    after the pod's last bytes (a client's HTTP/2 window held the answer's head back, say), is
    looked at at its last chunk's time plus ``stall_s``, with a loop timer of its own.

    The tolerance is a share of ``stall_s``, not a fixed time: a burst of 2000 streams starts its
    watches up to a second after their pods' first bytes (the loop admits them in turn), and with a
    fixed 0.1 s every one of them took a loop timer of its own (~0.5 KB a stream for its life).
    """

    __slots__ = ("_first", "_handle", "_loop", "_resp", "_stall_s")

    # of stall_s: how much later than its due time a first look may come
    FIRST_LOOK_LATE: ClassVar[float] = 0.05

    def __init__(self, resp: PodResponse, stall_s: float) -> None:
        self._resp = resp
        self._stall_s = stall_s
        self._loop = loop = resp._conn.loop
        self._handle: asyncio.TimerHandle | None = None
        self._first: SameDelayTimers | None = None
        if loop.time() - resp.last_at <= stall_s * self.FIRST_LOOK_LATE:
            self._first = resp._conn.pool.stall_timeouts(stall_s)
            self._first.set(loop, self, self._check)
        else:
            self._handle = loop.call_at(resp.last_at + stall_s, self._check)

    def _check(self) -> None:
        due = self._resp.last_at + self._stall_s
        if self._loop.time() >= due:
            self._handle = None
            self._resp.close(PodStalledError(f"no bytes from the pod for {self._stall_s:g} s"))
        else:
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._first is not None:
            self._first.cancel(self)
        if self._handle is not None:
            self._handle.cancel()
