"""A minimal HTTP/3 client on aioquic: one QUIC connection, many streamed requests.

Just enough for the chat client: connect (with a handshake deadline), send a request, get the
status and headers, then the body as it arrives, chunk by chunk, with typed errors for the
things the client decides on: the handshake failed (``QuicConnectError``: the race falls back to
TCP), the server reset the stream (``H3StreamReset``, e.g. H3_VERSION_FALLBACK), the connection
died (``H3ConnectionLost``).

The UDP socket is *connected*, unlike aioquic's own ``connect()``: the kernel then reports an
ICMP "port unreachable" as ``ECONNREFUSED``, so a closed UDP port fails the handshake at once
instead of after the whole handshake timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, StreamReset

H3_NO_ERROR = 0x100
H3_REQUEST_REJECTED = 0x10B
H3_REQUEST_CANCELLED = 0x10C
H3_VERSION_FALLBACK = 0x110  # RFC 9114 8.1: "retry over HTTP/1.1"

Verify = bool | str | os.PathLike[str]


class QuicConnectError(ConnectionError):
    """The QUIC handshake did not complete: refused, timed out, or rejected (TLS, version)."""


class H3StreamReset(ConnectionError):
    """The server reset the request stream with an HTTP/3 error code."""

    def __init__(self, error_code: int) -> None:
        super().__init__(f"HTTP/3 stream reset by the server (error 0x{error_code:x})")
        self.error_code = error_code


class H3ConnectionLost(ConnectionError):
    """The QUIC connection ended while a request was in flight (or before it could start)."""

    def __init__(self, error_code: int, reason: str = "") -> None:
        super().__init__(f"QUIC connection closed (error 0x{error_code:x}{': ' + reason if reason else ''})")
        self.error_code = error_code
        self.reason = reason


class _Stream:
    """One request's receive side: the response headers, then body chunks, or an error."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.headers: asyncio.Future[list[tuple[bytes, bytes]]] = loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.ended = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def on_headers(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        if not self.headers.done():
            status = dict(headers).get(b":status", b"")
            if status.startswith(b"1"):
                return  # an interim (1xx) response: the real one follows
            self.headers.set_result(headers)
        # later HEADERS frames are trailers: nothing in them matters to the chat client
        if ended:
            self.on_end()

    def on_data(self, data: bytes, ended: bool) -> None:
        if data:
            self.chunks.append(data)
        if ended:
            self.ended = True
        self._wake()

    def on_end(self) -> None:
        self.ended = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if self.ended and not self.chunks and self.headers.done():
            return  # already complete: a late reset changes nothing
        if self.error is None:
            self.error = exc
        if not self.headers.done():
            self.headers.set_exception(exc)
            self.headers.exception()  # mark retrieved: the request() caller may have gone
        self._wake()


class _Protocol(QuicConnectionProtocol):
    """aioquic's protocol plus an H3 layer that routes events to per-request ``_Stream``s."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None) -> None:
        super().__init__(quic, stream_handler=stream_handler)
        self.h3 = H3Connection(quic)
        self.streams: dict[int, _Stream] = {}
        self.lost: H3ConnectionLost | None = None
        loop = asyncio.get_running_loop()
        # settled by the handshake's end, its failure, or an ICMP error; not aioquic's
        # wait_connected(), whose waiter is left holding an unretrieved error when abandoned
        self.handshake: asyncio.Future[None] = loop.create_future()

    def _settle(self, exc: BaseException | None) -> None:
        if not self.handshake.done():
            if exc is None:
                self.handshake.set_result(None)
            else:
                self.handshake.set_exception(exc)
                self.handshake.exception()

    def quic_event_received(self, event: Any) -> None:
        if isinstance(event, HandshakeCompleted):
            self._settle(None)
        elif isinstance(event, ConnectionTerminated):
            self.lost = H3ConnectionLost(event.error_code, event.reason_phrase)
            self._settle(QuicConnectError(f"QUIC handshake failed: {self.lost}"))
            for stream in self.streams.values():
                stream.fail(self.lost)
            self.streams.clear()
            return
        elif isinstance(event, StreamReset):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                stream.fail(H3StreamReset(event.error_code))
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                stream = self.streams.get(h3_event.stream_id)
                if stream is not None:
                    stream.on_headers(h3_event.headers, h3_event.stream_ended)
            elif isinstance(h3_event, DataReceived):
                stream = self.streams.get(h3_event.stream_id)
                if stream is not None:
                    stream.on_data(h3_event.data, h3_event.stream_ended)
            else:
                continue
            if stream is not None and stream.ended:
                self.streams.pop(h3_event.stream_id, None)

    def error_received(self, exc: Exception) -> None:
        """ICMP errors on the connected UDP socket (port unreachable, host unreachable)."""
        if isinstance(exc, OSError):
            self._settle(QuicConnectError(f"QUIC refused: {exc}"))


def quic_configuration(server_name: str, verify: Verify, idle_timeout: float) -> QuicConfiguration:
    """An HTTP/3 client configuration; ``verify`` is True, False, or a CA bundle path."""
    config = QuicConfiguration(
        is_client=True, alpn_protocols=H3_ALPN, server_name=server_name, idle_timeout=idle_timeout
    )
    if verify is False:
        config.verify_mode = ssl.CERT_NONE
    else:
        config.verify_mode = ssl.CERT_REQUIRED
        if verify is not True:
            config.load_verify_locations(cafile=os.fspath(verify))
    return config


class H3Response:
    """A response whose headers have arrived; the body is read with ``aiter_bytes``."""

    def __init__(
        self, conn: H3ClientConnection, stream_id: int, stream: _Stream, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._conn = conn
        self._stream = stream
        self.stream_id = stream_id
        self.status = int(dict(headers).get(b":status", b"0"))
        self.headers = [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in headers if not k.startswith(b":")
        ]
        self.closed = False

    def header_values(self, name: str) -> list[str]:
        """All values of a header (names are lower case in HTTP/3)."""
        return [v for k, v in self.headers if k == name]

    async def aiter_bytes(self, read_timeout: float | None = None) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises the stream's error, or TimeoutError on a stall."""
        stream = self._stream
        loop = asyncio.get_running_loop()
        while True:
            while stream.chunks:
                yield stream.chunks.popleft()
            if stream.error is not None:
                raise stream.error
            if stream.ended:
                self.closed = True
                return
            stream.waiter = loop.create_future()
            try:
                async with asyncio.timeout(read_timeout):
                    await stream.waiter
            finally:
                stream.waiter = None

    async def read(self, read_timeout: float | None = None) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.aiter_bytes(read_timeout)])

    async def aclose(self) -> None:
        """Stop the response early (STOP_SENDING); a finished response just lets go."""
        if not self.closed:
            self.closed = True
            self._conn._cancel(self.stream_id)


class H3ClientConnection:
    """One QUIC connection carrying HTTP/3 requests; ``connect`` returns once the handshake is done."""

    def __init__(self, protocol: _Protocol, transport: asyncio.DatagramTransport, handshake_s: float) -> None:
        self._protocol = protocol
        self._transport = transport
        self.handshake_s = handshake_s
        self.closed = False

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        server_name: str | None = None,
        verify: Verify = True,
        handshake_timeout: float = 10.0,
        idle_timeout: float = 60.0,
    ) -> H3ClientConnection:
        """Open a QUIC connection to ``host``:``port`` and complete its handshake.

        ``server_name`` is the origin's host (SNI and certificate check) when ``host`` is an
        alternative's. Raises ``QuicConnectError`` when the handshake does not complete in time.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as exc:
            raise QuicConnectError(f"cannot resolve {host}: {exc}") from exc
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect(addr)
        except OSError as exc:
            sock.close()
            raise QuicConnectError(f"cannot reach {host}:{port} over UDP: {exc}") from exc
        config = quic_configuration(server_name or host, verify, idle_timeout)
        quic = QuicConnection(configuration=config)
        transport, protocol = await loop.create_datagram_endpoint(lambda: _Protocol(quic), sock=sock)
        assert isinstance(protocol, _Protocol)
        conn = cls(protocol, transport, 0.0)
        try:
            protocol.connect(addr)
            async with asyncio.timeout(handshake_timeout):
                await asyncio.shield(protocol.handshake)
        except TimeoutError:
            conn._abort()
            raise QuicConnectError(f"QUIC handshake with {host}:{port} timed out") from None
        except QuicConnectError as exc:
            conn._abort()
            raise QuicConnectError(f"{host}:{port}: {exc}") from exc
        except BaseException:
            conn._abort()
            raise
        conn.handshake_s = loop.time() - started
        return conn

    @property
    def is_usable(self) -> bool:
        """Open, not closing, and able to take a new request."""
        return not self.closed and self._protocol.lost is None

    @property
    def smoothed_rtt(self) -> float | None:
        """QUIC's smoothed RTT estimate (RFC 9002), or the handshake time when there is none.

        aioquic keeps the estimate on a private object; if that ever moves, the handshake time
        (one round trip plus crypto work) is a slightly pessimistic stand-in.
        """
        loss = getattr(self._protocol._quic, "_loss", None)
        if loss is not None and getattr(loss, "_rtt_initialized", False):
            rtt = getattr(loss, "_rtt_smoothed", None)
            if isinstance(rtt, float) and rtt > 0:
                return rtt
        return self.handshake_s or None

    async def request(
        self,
        method: str,
        authority: str,
        path: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
        *,
        read_timeout: float | None = None,
    ) -> H3Response:
        """Send a request and wait for the response headers (1xx skipped)."""
        protocol = self._protocol
        if protocol.lost is not None:
            raise protocol.lost
        if self.closed:
            raise H3ConnectionLost(H3_NO_ERROR, "closed by the client")
        quic = protocol._quic
        stream_id = quic.get_next_available_stream_id()
        stream = _Stream(asyncio.get_running_loop())
        protocol.streams[stream_id] = stream
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers),
        ]
        protocol.h3.send_headers(stream_id, fields, end_stream=not body)
        if body:
            protocol.h3.send_data(stream_id, body, end_stream=True)
        protocol.transmit()
        try:
            async with asyncio.timeout(read_timeout):
                response_headers = await asyncio.shield(stream.headers)
        except BaseException:
            self._cancel(stream_id)
            raise
        return H3Response(self, stream_id, stream, response_headers)

    def _cancel(self, stream_id: int) -> None:
        protocol = self._protocol
        if protocol.streams.pop(stream_id, None) is None or protocol.lost is not None:
            return
        with contextlib.suppress(ValueError, AssertionError):
            protocol._quic.stop_stream(stream_id, H3_REQUEST_CANCELLED)
            protocol._quic.reset_stream(stream_id, H3_REQUEST_CANCELLED)
            protocol.transmit()

    def _abort(self) -> None:
        """Drop a connection that never worked: no draining, just release the socket."""
        self.closed = True
        with contextlib.suppress(Exception):
            self._protocol.close()
        self._stop_timer()
        self._transport.close()

    async def aclose(self, grace: float = 1.0) -> None:
        """Close with NO_ERROR and wait (briefly) for the peer to see it."""
        if self.closed:
            return
        self.closed = True
        protocol = self._protocol
        try:
            if protocol.lost is None:
                protocol.close(error_code=H3_NO_ERROR)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace):
                        await protocol.wait_closed()
        finally:
            self._stop_timer()
            self._transport.close()

    def _stop_timer(self) -> None:
        timer = getattr(self._protocol, "_timer", None)  # aioquic's loss/idle timer
        if timer is not None:
            timer.cancel()
