"""HTTP/3 for the gateway: aioquic's QUIC server with its ``H3Connection``, one ASGI call per stream.

``H3Protocol`` is aioquic's ``QuicConnectionProtocol`` for one QUIC connection; once the handshake
has chosen ALPN ``h3`` it feeds QUIC events to an ``H3Connection`` and runs the app once per request
stream through ``transports.asgi_stream.AsgiStream`` (shared with HTTP/2). ``H3Listener`` starts it
on a UDP port with ``aioquic.asyncio.serve``.

What aioquic leaves to its user, and how it is done here (see docs/transports.md):

- **Disconnects.** A client that cancels a response sends STOP_SENDING (aioquic then resets our
  sending side and reports ``StopSendingReceived``) and, if its request was still open, RESET_STREAM
  (``StreamReset``); a connection that closes, or goes silent past the idle timeout, ends with
  ``ConnectionTerminated``. Each reaches ``AsgiStream.lost()`` in the datagram (or timer) callback:
  ``http.disconnect`` at once, the relay's callback at once, and no later write to the reset stream
  (aioquic would raise on it).
- **Back-pressure.** aioquic queues whatever is written to a stream without limit. A ``send()`` whose
  stream has more than ``HIGH_WATER`` bytes not yet put into packets (the peer's flow-control window
  or the congestion window holds them back) waits until ``transmit()`` has sent it below
  ``LOW_WATER``; ``transmit()`` runs in the loop turn after every datagram received (ACKs,
  MAX_STREAM_DATA) and on every timer. So a client that stops reading costs its window plus
  ``HIGH_WATER`` per stream, no more. The relay's body chunks arrive by splice
  (``AsgiStream.writer``, as for HTTP/2): a ``False`` from ``send_data`` pauses the pod's reads.
- **One transmit per connection per loop turn**: sends and received datagrams (mostly the client's
  ACKs) only schedule ``transmit`` (aioquic's ``_transmit_soon``; aioquic's own
  ``datagram_received`` transmits at once, a scan of every stream per datagram), which builds and
  encrypts the packets for everything written meanwhile; a new request's task, scheduled by its
  datagram, runs before that transmit, so its pod request leaves first. One exception, for the time
  to first token: a response's first DATA (the first token, with the HEADERS framed just before it)
  is transmitted at once, in ``send()``. ``transports.h3_aioquic`` makes each transmit walk the
  streams once rather than twice per packet.
- **Bursts**: a request stream's task starts through ``transports.stream_starts`` (as HTTP/2's):
  one per connection and a few in all per loop turn, the rest on the turns after. A stream whose
  STOP_SENDING came in the same packet as its HEADERS (aioquic handles a packet's control frames
  first, so the cancellation found no stream) is dropped as it is read.
- **Graceful shutdown**: ``shutdown()`` sends an HTTP/3 GOAWAY on the control stream, refuses newer
  request streams (H3_REQUEST_REJECTED), and closes the connection when the open ones end.
- **Early answers** (a 413 for an oversized body, a 400/401/429 or a gRPC error decided before the
  upload is over): the complete response (HEADERS, DATA, FIN) goes out, then the rest of the upload
  is accepted and dropped, up to ``drain_body_bytes`` / ``drain_body_s``, and only past that budget
  is the client asked to stop (STOP_SENDING H3_NO_ERROR, RFC 9114 section 4.1.1). Our response is
  never reset. Chromium fails a request whose upload is stopped while one of its writes waits for
  flow-control credit, even with H3_NO_ERROR and the whole response received (its stream closes
  with ERR_QUIC_PROTOCOL_ERROR unless its own FIN was sent), so stopping at once, as HTTP/2 does
  with RST_STREAM NO_ERROR, would lose the answer in the browser.
- **Limits** (``transports.h3_guard``): concurrent request streams, the connection table, Retry,
  handshake deadline, CRYPTO buffering; and a client that does not read for ``stall_s`` has its
  stream reset (H3_REQUEST_CANCELLED) and the app told it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import H3_ALPN, ErrorCode, FrameType, H3Connection, HeadersState, encode_frame
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.h3.exceptions import H3Error
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicErrorCode
from aioquic.quic.stream import QuicStreamSender

from transports import h3_aioquic
from transports.asgi_stream import AsgiStream, Headers, peer_address, request_scope, start_task
from transports.h3_guard import H3Limits, H3Stats, apply_stream_limits, bound_crypto_buffers, serve_guarded
from transports.stream_starts import stream_starts

logger = logging.getLogger("sluicegate.transports")

HIGH_WATER = 64 * 1024  # bytes written to a stream and not yet sent: above this, send() waits
LOW_WATER = 16 * 1024  # ... until transmit() has sent it below this

_SEND_ERRORS = (H3Error, AssertionError, RuntimeError, ValueError)


def quic_configuration(
    cert: str | Path,
    key: str | Path,
    *,
    idle_timeout_s: float = 30.0,
    max_stream_data: int = 256 * 1024,
    max_data: int = 1024 * 1024,
) -> QuicConfiguration:
    """The server's QUIC/TLS 1.3 settings from the same PEM files as the TLS listener (ALPN h3)."""
    configuration = QuicConfiguration(
        is_client=False,
        alpn_protocols=H3_ALPN,
        idle_timeout=idle_timeout_s,
        max_stream_data=max_stream_data,
        max_data=max_data,
    )
    configuration.load_cert_chain(str(cert), str(key))
    return configuration


def _unsent(quic: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream that aioquic has not yet put into a packet (0 if it is gone).

    aioquic keeps no such count; ``QuicStreamSender`` holds the buffer's end offset and the highest
    offset ever sent (internals, checked by tests/test_h3_server.py)."""
    stream = quic._streams.get(stream_id)
    if stream is None:
        return 0
    sender = stream.sender
    return sender._buffer_stop - sender.highest_offset


def _open_sender(h3: H3Connection, quic: QuicConnection, stream_id: int) -> QuicStreamSender | None:
    """The QUIC sender of a response already past its HEADERS, for a mid-stream DATA frame written
    straight to it; None wherever aioquic's ``send_data`` must decide (a stream it has ended,
    discarded or does not know, a QUIC logger to tell).

    For such a stream aioquic's ``H3Connection.send_data`` checks the state this checks, then
    ``QuicConnection.send_stream_data`` finds the stream sendable and not discarded (it is still in
    ``_streams``) and calls the same ``write``: ~16 Python calls a token, a context manager among
    them, for two dictionary look-ups (internals, checked by tests/test_h3_send_path.py)."""
    h3_stream = h3._stream.get(stream_id)
    quic_stream = quic._streams.get(stream_id)
    if (
        h3_stream is None
        or quic_stream is None
        or h3_stream.headers_send_state is not HeadersState.AFTER_HEADERS
        or h3._quic_logger is not None
    ):
        return None
    return quic_stream.sender


def write_data(h3: H3Connection, quic: QuicConnection, stream_id: int, data: bytes, end_stream: bool) -> bool:
    """A DATA frame on a response stream, as aioquic's ``send_data`` writes it (and raising as it
    does); a mid-stream one the short way when ``_open_sender`` allows. Whether it went that way."""
    sender = None if end_stream else _open_sender(h3, quic, stream_id)
    if sender is None:
        h3.send_data(stream_id, data, end_stream)
        return False
    sender.write(encode_frame(FrameType.DATA, data))
    return True


def _answer_refused(quic: QuicConnection, stream_id: int) -> bool:
    """Whether the client's STOP_SENDING for this stream came before its HEADERS (in the same
    packet: aioquic handles a packet's control frames before its stream data). aioquic has reset
    our side already, and the cancellation found no stream to tell; the reset is in its
    ``QuicStreamSender`` (internals, checked by tests/test_h3_server.py)."""
    stream = quic._streams.get(stream_id)
    return stream is not None and stream.sender._reset_error_code is not None


class H3Protocol(QuicConnectionProtocol):
    """One QUIC connection speaking HTTP/3 to the ASGI app."""

    splices = True  # streams take the relay's body chunks from a callback (``AsgiStream.writer``)

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *, listener: H3Listener) -> None:
        super().__init__(quic, stream_handler)
        self.listener = listener
        self.app = listener.app
        self.server_state = listener.server_state
        self.limits = listener.limits
        self.stats = listener.stats
        self.h3: H3Connection | None = None
        self.streams: dict[int, AsgiStream] = {}
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.closing = False
        self._highest_stream = -4
        self._blocked: dict[int, AsgiStream] = {}
        self._fresh: set[int] = set()  # streams whose response HEADERS are written, not yet transmitted
        # early-answered requests whose upload is still accepted: [bytes left, deadline timer]
        self._draining: dict[int, list[Any]] = {}
        apply_stream_limits(quic, self.limits)
        self.stats.connections += 1
        self.stats.handshaking += 1
        self._handshake_timer: asyncio.TimerHandle | None = self._loop.call_later(
            self.limits.handshake_timeout_s, self._handshake_expired
        )
        self._counted = True
        self._starts = stream_starts(self._loop)

    # -- QuicConnectionProtocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server = peer_address(transport.get_extra_info("sockname"))  # the listener's UDP socket
        self.server_state.connections.add(self)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic's own version ends with transmit(), a scan of every stream and a packet built,
        # per datagram (mostly the client's ACKs); deferred, one transmit serves every datagram and
        # every send of this loop turn (and a new request's task, scheduled already, goes first).
        if self.client is None:
            self.client = peer_address(addr)
        self._quic.receive_datagram(data, addr, now=self._loop.time())  # type: ignore[arg-type]
        self._process_events()
        self._transmit_soon()

    def transmit(self) -> None:
        super().transmit()
        self._fresh.clear()
        if self._blocked:
            quic = self._quic
            for sid, stream in list(self._blocked.items()):
                if _unsent(quic, sid) <= LOW_WATER:
                    del self._blocked[sid]
                    stream.writable()

    def quic_event_received(self, event: QuicEvent) -> None:
        if self._handshake_timer is not None and isinstance(event, HandshakeCompleted):
            self._handshake_done()
        h3 = self.h3
        if h3 is None:
            if isinstance(event, ProtocolNegotiated):
                if event.alpn_protocol in H3_ALPN:
                    self.h3 = H3Connection(self._quic)
                    if not self.listener.accepting:
                        self._refuse_connection()
            elif isinstance(event, ConnectionTerminated):
                self._terminated()
            return
        for h3_event in h3.handle_event(event):
            if isinstance(h3_event, DataReceived):
                stream = self.streams.get(h3_event.stream_id)
                if stream is not None:
                    if h3_event.data:
                        stream.feed_body(h3_event.data, 0)
                    if h3_event.stream_ended:
                        stream.feed_end()
                elif h3_event.stream_id in self._draining:
                    self._drained(h3_event.stream_id, len(h3_event.data), h3_event.stream_ended)
            elif isinstance(h3_event, HeadersReceived):
                self._on_headers(h3_event)
        if isinstance(event, StopSendingReceived):
            self._on_cancel(event.stream_id, False)
        elif isinstance(event, StreamReset):
            self._on_cancel(event.stream_id, True)
        elif isinstance(event, ConnectionTerminated):
            self._terminated()

    # -- uvicorn's server: graceful shutdown ----------------------------------------------------

    def shutdown(self) -> None:
        """Send GOAWAY, refuse newer request streams, close once the open ones are done."""
        if self.closing:
            return
        self.closing = True
        h3 = self.h3
        control = getattr(h3, "_local_control_stream_id", None)
        if h3 is not None and control is not None and self.streams:
            # aioquic has no GOAWAY of its own; the frame carries the first stream id not served.
            frame = encode_frame(FrameType.GOAWAY, encode_uint_var(self._highest_stream + 4))
            self._quic.send_stream_data(control, frame)
            self._transmit_soon()
        else:
            self._close_connection()

    # -- HTTP/3 events ---------------------------------------------------------------------------

    def _on_headers(self, event: HeadersReceived) -> None:
        sid = event.stream_id
        stream = self.streams.get(sid)
        if stream is not None:  # trailers
            if event.stream_ended:
                stream.feed_end()
            return
        if sid <= self._highest_stream:  # a late HEADERS (trailers) for a stream already answered
            if sid in self._draining:
                self._drained(sid, 0, event.stream_ended)
            return
        self._highest_stream = sid
        if _answer_refused(self._quic, sid):
            # cancelled before it was read: nothing to serve; the rest of an open request is not wanted
            if not event.stream_ended:
                with contextlib.suppress(ValueError):
                    self._quic.stop_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
                self._transmit_soon()
            return
        if self.closing or len(self.streams) + len(self._draining) >= self.limits.max_concurrent_streams:
            # shutting down, or over our own cap (aioquic's stream credit comes back before our
            # task for a cancelled stream is done): not processed, the client may retry it
            if not self.closing:
                self.stats.streams_rejected += 1
            self._quic.reset_stream(sid, ErrorCode.H3_REQUEST_REJECTED)
            with contextlib.suppress(ValueError):
                self._quic.stop_stream(sid, ErrorCode.H3_REQUEST_REJECTED)
            self._transmit_soon()
            return
        scope = request_scope(
            http_version="3",
            scheme="https",
            headers=event.headers,
            server=self.server,
            client=self.client,
            root_path=self.listener.root_path,
            state=self.listener.app_state,
        )
        if scope is None:
            self._quic.reset_stream(sid, ErrorCode.H3_MESSAGE_ERROR)
            self._transmit_soon()
            return
        stream = AsgiStream(self, sid, scope, self.listener.stall_s)
        self.streams[sid] = stream
        if event.stream_ended:
            stream.feed_end()
        self._starts.start(self, self._begin, stream)

    def _begin(self, stream: AsgiStream) -> bool:
        """The stream's task: now, or a few loop turns into a burst (``transports/stream_starts.py``)."""
        return start_task(stream, self.app, self.server_state.tasks)

    def _on_cancel(self, stream_id: int, request_reset: bool) -> None:
        """STOP_SENDING (our sending side is already reset) or RESET_STREAM of the request."""
        self._blocked.pop(stream_id, None)
        drain = self._draining.pop(stream_id, None)
        if drain is not None:  # the client gave up the rest of its upload: nothing left to do
            drain[1].cancel()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if request_reset and not stream.closed:
            # The request is abandoned: stop our side too (no-op after STOP_SENDING or the end).
            with contextlib.suppress(ValueError):
                self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._transmit_soon()
        stream.lost()

    def _terminated(self) -> None:
        self.server_state.connections.discard(self)
        self._blocked.clear()
        for _, timer in self._draining.values():
            timer.cancel()
        self._draining.clear()
        if self._handshake_timer is not None:
            self._handshake_done()
        if self._counted:
            self._counted = False
            self.stats.connections -= 1
        for stream in list(self.streams.values()):
            stream.lost()
        # the connection's own cycles (``h3_aioquic.release``), and the server's handlers, which
        # hold this protocol (aioquic called them before this event reached us)
        h3_aioquic.release(self._quic)
        self._connection_id_issued_handler = self._connection_id_retired_handler = h3_aioquic.ignore
        self._connection_terminated_handler = h3_aioquic.ignore

    # -- StreamConnection (called by AsgiStream) -------------------------------------------------

    def send_headers(self, stream: AsgiStream, headers: Headers, end_stream: bool) -> None:
        assert self.h3 is not None
        headers.extend(self.server_state.default_headers)
        try:
            self.h3.send_headers(stream.stream_id, headers, end_stream)
        except _SEND_ERRORS as exc:
            logger.warning("cannot send response headers on stream %d: %s", stream.stream_id, exc)
            self.abort(stream)
            stream.lost()
            return
        self._fresh.add(stream.stream_id)
        self._transmit_soon()

    def send_data(self, stream: AsgiStream, data: bytes, end_stream: bool) -> bool:
        sid = stream.stream_id
        assert self.h3 is not None
        try:
            write_data(self.h3, self._quic, sid, data, end_stream)
        except _SEND_ERRORS:
            stream.lost()
            return True
        if sid in self._fresh:
            # the response's first DATA (the first token): out now, with its HEADERS
            if self._transmit_task is not None:
                self._transmit_task.cancel()
            self.transmit()
        else:
            self._transmit_soon()
        if _unsent(self._quic, sid) > HIGH_WATER:
            self._blocked[sid] = stream
            return False
        return True

    def consumed(self, stream: AsgiStream, size: int) -> None:
        pass  # aioquic extends QUIC flow-control windows by itself as data arrives

    def abort(self, stream: AsgiStream) -> None:
        self._blocked.pop(stream.stream_id, None)
        with contextlib.suppress(ValueError):
            self._quic.reset_stream(stream.stream_id, ErrorCode.H3_INTERNAL_ERROR)
        self._transmit_soon()

    def stalled(self, stream: AsgiStream) -> None:
        # The request is cancelled, not failed: H3_REQUEST_CANCELLED both ways (RFC 9114 8.1).
        sid = stream.stream_id
        self._blocked.pop(sid, None)
        self.stats.stalls += 1
        with contextlib.suppress(ValueError):
            self._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
            if not stream.request_complete:
                self._quic.stop_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
        self._transmit_soon()

    def stream_done(self, stream: AsgiStream) -> None:
        sid = stream.stream_id
        self.streams.pop(sid, None)
        self._blocked.pop(sid, None)
        if stream.ended and not stream.gone and not stream.request_complete:
            self._drain(sid)  # complete answer, request body still coming (see the module doc)
        if self.closing and not self.streams:
            self._close_connection()

    # -- early answers: the rest of the upload -------------------------------------------------

    def _drain(self, sid: int) -> None:
        limits = self.limits
        if limits.drain_body_bytes <= 0 or limits.drain_body_s <= 0:
            self._stop_upload(sid)
            return
        timer = self._loop.call_later(limits.drain_body_s, self._stop_upload, sid)
        self._draining[sid] = [limits.drain_body_bytes, timer]

    def _drained(self, sid: int, size: int, ended: bool) -> None:
        """Upload bytes of an answered request arrived (and were dropped as aioquic handed them over;
        aioquic keeps granting flow-control credit as data arrives)."""
        drain = self._draining[sid]
        if ended:
            del self._draining[sid]
            drain[1].cancel()
            self.stats.drains_completed += 1
            return
        drain[0] -= size
        if drain[0] < 0:
            self._stop_upload(sid)

    def _stop_upload(self, sid: int) -> None:
        """Past the drain budget: ask the client to stop its upload (RFC 9114 section 4.1.1)."""
        drain = self._draining.pop(sid, None)
        if drain is not None:
            drain[1].cancel()
        self.stats.drains_stopped += 1
        with contextlib.suppress(ValueError):
            self._quic.stop_stream(sid, ErrorCode.H3_NO_ERROR)
        self._transmit_soon()

    # -- the handshake deadline ------------------------------------------------------------------

    def _handshake_done(self) -> None:
        assert self._handshake_timer is not None
        self._handshake_timer.cancel()
        self._handshake_timer = None
        self.stats.handshaking -= 1

    def _handshake_expired(self) -> None:
        """A handshake still unfinished after ``handshake_timeout_s``: reclaim the connection."""
        self._handshake_timer = None
        self.stats.handshaking -= 1
        self.stats.handshakes_timed_out += 1
        self._quic.close(error_code=QuicErrorCode.CONNECTION_REFUSED, reason_phrase="handshake timeout")
        self.transmit()

    # -- internals -------------------------------------------------------------------------------

    def _refuse_connection(self) -> None:
        self.closing = True
        self._close_connection()

    def _close_connection(self) -> None:
        self.server_state.connections.discard(self)
        self.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="shutting down")


class H3Listener:
    """HTTP/3 on a UDP port, serving ``app`` with uvicorn's shared server state."""

    def __init__(
        self,
        app: Any,
        configuration: QuicConfiguration,
        server_state: Any,
        app_state: dict[str, Any],
        root_path: str = "",
        *,
        limits: H3Limits | None = None,
        stall_s: float | None = 30.0,
    ) -> None:
        self.app = app
        self.configuration = configuration
        self.server_state = server_state
        self.app_state = app_state
        self.root_path = root_path
        self.limits = limits or H3Limits()
        self.stall_s = stall_s  # see AsgiStream.stall_s
        self.stats = H3Stats()
        self.accepting = True
        self.server: QuicServer | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; returns the bound (host, port)."""

        def create_protocol(quic: QuicConnection, stream_handler: Any = None) -> H3Protocol:
            return H3Protocol(quic, stream_handler, listener=self)

        bound_crypto_buffers(self.limits.max_crypto_buffer_bytes)
        h3_aioquic.apply()
        self.server = await serve_guarded(
            host, port, limits=self.limits, stats=self.stats,
            configuration=self.configuration, create_protocol=create_protocol,
        )
        transport = self.server._transport
        assert transport is not None
        bound = transport.get_extra_info("sockname")
        return str(bound[0]), int(bound[1])

    def stop_accepting(self) -> None:
        """New connections are closed once negotiated (open ones go on; uvicorn drains them)."""
        self.accepting = False

    def close(self) -> None:
        """Close every connection that is left and the UDP socket."""
        if self.server is not None:
            self.server.close()
            self.server = None
