"""HTTP/2 for the gateway: an asyncio protocol on the h2 state machine.

``H2Protocol`` drives one ``h2.connection.H2Connection`` (server side) and runs the ASGI app once per
stream through ``transports.asgi_stream.AsgiStream``. The listeners hand it a connection once they
know it speaks HTTP/2 (prior knowledge on the cleartext port, ALPN ``h2`` under TLS): see
``transports/h2_dispatch.py``.

Design points (see docs/transports.md):

- **Disconnects**: RST_STREAM on a stream, a GOAWAY from the client (h2 can send nothing after one),
  EOF or a lost connection → ``AsgiStream.lost()`` for the streams concerned, from the I/O callback.
- **Flow control, both ways**: request bodies are acknowledged (WINDOW_UPDATE) as the app reads
  them, so a client cannot make the gateway buffer more than the window; a response chunk larger
  than the peer's window is sent as far as the window goes and the rest waits (the app's ``send()``
  with it) for WINDOW_UPDATE. When the transport's buffer passes its high-water mark every stream's
  next ``send()`` waits for ``resume_writing``.
- **The relay's splice** (``splices``): after the first token the relay's body chunks arrive from the
  pod connection's parser callback through ``AsgiStream.writer`` instead of one ASGI ``send()`` each;
  they take the same ``send_data`` path. A chunk that arrives while the stream's earlier bytes wait
  for the window queues behind them (the pod is paused meanwhile), so order is kept.
- **One write per connection per loop turn**: frames accumulate in h2's output buffer and a single
  ``transport.write`` (scheduled with ``call_soon``) sends what every stream produced meanwhile.
  Except for a response's first DATA (the first token, with the HEADERS framed just before it):
  that write happens at once, in ``send()``, as uvicorn's HTTP/1.1 does for every write; waiting
  for the end of the loop turn would add whatever the app does before it next awaits (the relay:
  ~0.1 ms) to the time to first token.
- **Graceful shutdown**: ``shutdown()`` (called by uvicorn's server for every connection) refuses
  new streams (REFUSED_STREAM), lets the open ones finish, then sends GOAWAY and closes.
- **Abusive clients** (``H2Limits``; the table in docs/hardening.md): floods are counted by
  ``transports.h2_guard.FloodGuard`` (GOAWAY ENHANCE_YOUR_CALM); streams past the cap get
  REFUSED_STREAM; a chunk waiting ``send_stall_s`` for the client's window resets its stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.connection import ConnectionState
from h2.errors import ErrorCodes
from h2.stream import StreamState

from transports import h2_patches
from transports.asgi_stream import AsgiStream, Headers, peer_address, request_scope, start_task
from transports.h1_limits import error_json
from transports.h2_guard import FloodGuard, H2Limits
from transports.hpack_stateless import StatelessEncoder
from transports.stream_starts import stream_starts

logger = logging.getLogger("sluicegate.transports")
h2_patches.apply()  # hpack's Huffman decoding remembered, its debug logging off

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FLUSH_AT = 64 * 1024  # write at once, not at the end of the loop turn, past this many unwritten bytes
READ_SLICE = 16 * 1024  # bytes handed to h2 at a time (see ``data_received``)
LINGER_S = 1.0  # after a GOAWAY for an error: how long what the client still sends is read and dropped
_DEFAULT_WINDOW = 65_535
_DATA_FRAME_HEADER = struct.Struct(">HBBBL")  # 24-bit length (16 + 8), type 0 (DATA), flags 0, stream
_SENDABLE = (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE)
_SERVER_OPEN = ConnectionState.SERVER_OPEN


@dataclass(frozen=True, slots=True)
class H2Settings:
    """What this server announces and enforces per HTTP/2 connection."""

    max_concurrent_streams: int = 128
    initial_window_size: int = 256 * 1024  # per stream, for request bodies
    connection_window_size: int = 1024 * 1024  # all streams' request bodies together
    max_header_list_size: int = 64 * 1024  # HPACK-decoded, 32 bytes counted per field (RFC 9113 6.5.2)
    limits: H2Limits = field(default_factory=H2Limits)


def _local_settings(s: H2Settings, max_streams: int) -> h2.settings.Settings:
    return h2.settings.Settings(
        client=False,
        initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: s.initial_window_size,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: s.max_header_list_size,
        },
    )


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection (cleartext or TLS): h2 events in, ASGI streams out."""

    splices = True  # streams take the relay's body chunks from a callback (``AsgiStream.writer``)

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        settings: H2Settings | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.root_path: str = config.root_path
        self.server_state = server_state
        self.app_state = app_state
        self.settings = settings or H2Settings()
        self.loop = _loop or asyncio.get_event_loop()
        self._starts = stream_starts(self.loop)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=False, header_encoding=None,
                # response headers are checked and normalised once, by ``AsgiStream.send``; h2's
                # own pass repeats it in ~10 Python calls a header (~15 % of a request's CPU)
                validate_outbound_headers=False, normalize_outbound_headers=False,
            )
        )
        self.h2.encoder = StatelessEncoder()  # no dynamic table, no Huffman: see its module
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, AsgiStream] = {}
        self.scheme = "http"
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.write_paused = False
        self.closing = False  # shutting down: no new streams, GOAWAY and close after the last one
        self.cut_off = False  # GOAWAY sent for an error: what the client sends now is dropped
        self.idle_timeout_s: float = config.timeout_keep_alive
        self._idle_timer: asyncio.TimerHandle | None = None
        # waiting for window: the chunk's rest and END_STREAM (AsgiStream times the wait)
        self._blocked: dict[int, tuple[AsgiStream, memoryview, bool]] = {}
        self._write_waiters: list[AsgiStream] = []  # waiting for the transport to drain
        self._flush_handle: asyncio.Handle | None = None
        self._unflushed = 0  # body bytes framed since the last write
        self.data_frames = 0  # DATA frames sent on this connection (see FloodGuard.window_update)
        self._fresh: set[int] = set()  # streams whose response HEADERS are framed and not yet written
        self._max_frame = self.h2.max_outbound_frame_size
        self.guard = FloodGuard(self.settings.limits, self.loop.time)
        self._priority_of_request: Any = None  # the PriorityUpdated h2 emits for a HEADERS' own flag
        self._write_stall_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self.server_state.connections.add(self)
        self.scheme = "https" if transport.get_extra_info("ssl_object") is not None else "http"
        self.server = peer_address(transport.get_extra_info("sockname"))
        self.client = peer_address(transport.get_extra_info("peername"))
        s = self.settings
        self.h2.local_settings = _local_settings(s, s.max_concurrent_streams)
        self.h2.initiate_connection()
        # What the client was told stays; h2 itself enforces a higher stream cap, so that streams
        # just past the announced one get REFUSED_STREAM (``_on_request``) rather than h2's GOAWAY
        # PROTOCOL_ERROR; a client that keeps going past twice the cap still gets that.
        self.h2.local_settings = _local_settings(s, 2 * s.max_concurrent_streams)
        self.h2.decoder.max_header_list_size = s.max_header_list_size  # h2 applies it only on ACK
        if s.connection_window_size > _DEFAULT_WINDOW:
            self.h2.increment_flow_control_window(s.connection_window_size - _DEFAULT_WINDOW)
        self._flush()
        self._arm_idle_timer(s.limits.head_timeout_s)

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self.cut_off:
            return
        if not transport.get_write_buffer_size():
            self.guard.drained()
        if len(data) <= READ_SLICE:
            self._receive(data)
        else:
            # h2 parses all it is given before returning a single event: in slices, a flood is
            # cut off after at most one slice more than its allowance, not a whole 256 KB read
            view = memoryview(data)
            for start in range(0, len(data), READ_SLICE):
                if not self._receive(view[start : start + READ_SLICE]):
                    return
        self._flush()

    def _receive(self, data: bytes | memoryview) -> bool:
        """Feed h2 and handle its events; False once the connection has been cut off."""
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            # h2 has queued a GOAWAY with the right error code (ENHANCE_YOUR_CALM for an HPACK
            # bomb, PROTOCOL_ERROR for a CONTINUATION flood past h2's 64 frames): send it, hang up.
            logger.info("HTTP/2 protocol error from %s: %s", self.client, exc)
            self._hang_up()
            return False
        handlers = self._HANDLERS
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(self, event)
                if self.cut_off:
                    return False  # (``_calm``): the rest of what it sent is not worth reading
        return True

    def eof_received(self) -> bool | None:
        self._lose_all()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._write_stall_timer is not None:
            self._write_stall_timer.cancel()
            self._write_stall_timer = None
        self._lose_all()
        h2_patches.release(self.h2)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._write_stall_timer is None:
            stall_s = self.settings.limits.send_stall_s
            self._write_stall_timer = self.loop.call_later(stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._write_stall_timer is not None:
            self._write_stall_timer.cancel()
            self._write_stall_timer = None
        waiters, self._write_waiters = self._write_waiters, []
        for stream in waiters:
            stream.writable()

    # -- uvicorn's server: graceful shutdown ----------------------------------------------------

    def shutdown(self) -> None:
        """Stop taking streams, let the open ones finish, then GOAWAY and close.

        The GOAWAY waits for the last stream: clients built on the h2 library (httpx, among others)
        fail every stream still open when a GOAWAY arrives, since h2 accepts no frame after one.
        Meanwhile a new stream is refused with REFUSED_STREAM, which tells the client it was not
        processed and may be retried on another connection."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        if not self.streams:
            self._close_gracefully()

    # -- h2 events -------------------------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        self._priority_of_request = event.priority_updated
        self.guard.empty_run = 0
        if self.closing:
            self._reset(sid, ErrorCodes.REFUSED_STREAM)
            return
        if len(self.streams) >= self.settings.max_concurrent_streams:
            self._reset(sid, ErrorCodes.REFUSED_STREAM)  # RFC 9113 5.1.2: may be retried elsewhere
            if self.guard.refused():
                self._calm()
            return
        if len(event.headers) > self.settings.limits.max_headers + 4:  # + the 4 pseudo-headers
            self._refuse(sid, 431, "too many request headers")
            return
        scope = request_scope(
            http_version="2",
            scheme=self.scheme,
            headers=event.headers,
            server=self.server,
            client=self.client,
            root_path=self.root_path,
            state=self.app_state,
        )
        if scope is None:
            self._reset(sid, ErrorCodes.PROTOCOL_ERROR)
            if self.guard.refused():
                self._calm()
            return
        stream = AsgiStream(self, sid, scope, self.settings.limits.send_stall_s)
        self.streams[sid] = stream
        self.guard.opened(sid)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._starts.start(self, self._begin, stream)

    def _begin(self, stream: AsgiStream) -> bool:
        """The stream's task: now, or a few loop turns into a burst (``transports/stream_starts.py``)."""
        return start_task(stream, self.app, self.server_state.tasks)

    def _on_data(self, event: h2.events.DataReceived) -> None:
        if event.data:
            self.guard.empty_run = 0
        elif event.stream_ended is None and self.guard.empty_frame():
            self._calm()
            return
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.feed_body(event.data, event.flow_controlled_length)
        elif event.flow_controlled_length:
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def _on_stream_ended(self, event: h2.events.StreamEnded) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.feed_end()

    def _on_stream_reset(self, event: h2.events.StreamReset) -> None:
        self._blocked.pop(event.stream_id, None)
        # no longer counted against MAX_CONCURRENT_STREAMS, even before its task ends (``stream_done``)
        stream = self.streams.pop(event.stream_id, None)
        if stream is not None:
            stream.lost()
            if event.remote_reset and not stream.ended and self.guard.reset_by_client(event.stream_id):
                self._calm()

    def _on_window_updated(self, event: h2.events.WindowUpdated) -> None:
        if self.guard.window_update(self.data_frames):
            self._calm()
            return
        if not self._blocked:
            return
        if event.stream_id == 0:
            for sid in list(self._blocked):
                self._unblock(sid)
        elif event.stream_id in self._blocked:
            self._unblock(event.stream_id)

    def _on_settings_changed(self, event: h2.events.RemoteSettingsChanged) -> None:
        if self.guard.control_frame(replies=1):  # h2 queued a SETTINGS ACK
            self._calm()
            return
        self._max_frame = self.h2.max_outbound_frame_size
        for sid in list(self._blocked):  # a larger initial window may open blocked streams
            self._unblock(sid)

    def _on_ping(self, event: h2.events.PingReceived) -> None:
        if self.guard.control_frame(replies=1):  # h2 queued the PING ACK
            self._calm()

    def _on_priority(self, event: h2.events.PriorityUpdated) -> None:
        if event is not self._priority_of_request and self.guard.control_frame():
            self._calm()

    def _on_unknown_frame(self, event: h2.events.UnknownFrameReceived) -> None:
        if self.guard.control_frame():
            self._calm()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        # h2 sends nothing after a peer's GOAWAY, so every stream is over for the client.
        self._lose_all()
        self._close()

    # h2's event type -> its handler, on the class: the bound methods in a dict of each connection's
    # own made every connection a cycle, freed only by a later (full) collection
    _HANDLERS: ClassVar[dict[type[h2.events.Event], Callable[[H2Protocol, Any], None]]] = {
        h2.events.RequestReceived: _on_request,
        h2.events.DataReceived: _on_data,
        h2.events.StreamEnded: _on_stream_ended,
        h2.events.StreamReset: _on_stream_reset,
        h2.events.WindowUpdated: _on_window_updated,
        h2.events.RemoteSettingsChanged: _on_settings_changed,
        h2.events.ConnectionTerminated: _on_goaway,
        h2.events.PingReceived: _on_ping,
        h2.events.PriorityUpdated: _on_priority,
        h2.events.UnknownFrameReceived: _on_unknown_frame,
    }

    # -- StreamConnection (called by AsgiStream) -------------------------------------------------

    def send_headers(self, stream: AsgiStream, headers: Headers, end_stream: bool) -> None:
        headers.extend(self.server_state.default_headers)
        try:
            self.h2.send_headers(stream.stream_id, headers, end_stream=end_stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
            # a closed stream, or headers h2 refuses (e.g. a newline in a value): the answer cannot go
            logger.warning("cannot send response headers on stream %d: %s", stream.stream_id, exc)
            self.abort(stream)
            stream.lost()
            return
        self._fresh.add(stream.stream_id)
        self._flush_soon()

    def send_data(self, stream: AsgiStream, data: bytes, end_stream: bool) -> bool:
        sid = stream.stream_id
        conn = self.h2
        size = len(data)
        h2_stream = conn.streams.get(sid)
        if (
            # The hot path, a body chunk mid-response that fits the windows and one frame: frame it
            # here. h2's own send_data costs ~16 us a call on this machine (two state machines,
            # frame objects, serialization), more than the rest of the relay per token; what it
            # would do for such a frame is exactly this: check the states, take the size off both
            # windows, append the frame to the output buffer.
            h2_stream is not None
            and size
            and not end_stream
            and sid not in self._blocked
            and size <= self._max_frame
            and size <= conn.outbound_flow_control_window
            and size <= h2_stream.outbound_flow_control_window
            and h2_stream.state_machine.state in _SENDABLE
            and conn.state_machine.state is _SERVER_OPEN
        ):
            h2_stream.outbound_flow_control_window -= size
            conn.outbound_flow_control_window -= size
            out = conn._data_to_send
            out += _DATA_FRAME_HEADER.pack(size >> 8, size & 0xFF, 0, 0, sid)
            out += data
        else:
            try:
                blocked = self._blocked.get(sid)
                if blocked is not None:  # a splice's earlier chunk still waits for the window: queue behind
                    self._blocked[sid] = (stream, memoryview(b"".join((blocked[1], data))), end_stream)
                elif size <= self._max_frame and size <= conn.local_flow_control_window(sid):
                    conn.send_data(sid, data, end_stream=end_stream)
                else:
                    self._blocked[sid] = (stream, memoryview(data), end_stream)
                    self._push(sid)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                self._blocked.pop(sid, None)
                stream.lost()
                return True
        self._unflushed += size
        self.data_frames += 1  # what the window-update allowance is measured against
        if self._unflushed > FLUSH_AT:
            self._flush()  # an app that never yields must still meet the transport's high-water mark
        elif sid in self._fresh:
            self._flush()  # the response's first DATA (the first token): out now, with its HEADERS
        else:
            self._flush_soon()
        if sid in self._blocked:
            return False  # _unblock wakes it
        if self.write_paused:
            self._write_waiters.append(stream)
            return False
        return True

    def consumed(self, stream: AsgiStream, size: int) -> None:
        try:
            self.h2.acknowledge_received_data(size, stream.stream_id)
        except h2.exceptions.ProtocolError:
            return
        self._flush_soon()

    def stalled(self, stream: AsgiStream) -> None:
        """A chunk waited ``send_stall_s`` for the client's window or reads: reset the stream (the
        stream then reports itself lost, and the relay aborts the pod's generation)."""
        self._blocked.pop(stream.stream_id, None)
        logger.info(
            "HTTP/2 client %s: stream %d stalled on flow control, reset", self.client, stream.stream_id
        )
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.reset_stream(stream.stream_id, ErrorCodes.CANCEL)
        self._flush_soon()

    def abort(self, stream: AsgiStream) -> None:
        self._blocked.pop(stream.stream_id, None)
        try:
            self.h2.reset_stream(stream.stream_id, ErrorCodes.INTERNAL_ERROR)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self._flush_soon()

    def stream_done(self, stream: AsgiStream) -> None:
        sid = stream.stream_id
        self.streams.pop(sid, None)
        self.guard.closed(sid)
        self._blocked.pop(sid, None)
        if stream.unconsumed:
            self.consumed(stream, stream.unconsumed)
            stream.unconsumed = 0
        if stream.ended and not stream.gone and not stream.request_complete:
            # Complete answer, request body still coming: ask the client to stop (RFC 9113 8.1).
            with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                self.h2.reset_stream(sid, ErrorCodes.NO_ERROR)
            self._flush_soon()
        if not self.streams:
            if self.closing:
                self._close_gracefully()
            else:
                self._arm_idle_timer()

    # -- internals -------------------------------------------------------------------------------

    def _push(self, sid: int) -> None:
        """Send as much of a blocked stream's chunk as the window allows (in frame-sized pieces)."""
        stream, view, end = self._blocked[sid]
        conn = self.h2
        while True:
            size = min(len(view), conn.local_flow_control_window(sid), self._max_frame)
            last = size == len(view)
            if size <= 0 and not last:
                self._blocked[sid] = (stream, view, end)
                return
            conn.send_data(sid, view[:size].tobytes(), end_stream=end and last)
            if last:
                del self._blocked[sid]
                return
            view = view[size:]

    def _unblock(self, sid: int) -> None:
        stream = self._blocked[sid][0]
        try:
            self._push(sid)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._blocked.pop(sid, None)
            stream.lost()
            return
        if sid not in self._blocked:
            if self.write_paused:
                self._write_waiters.append(stream)
            else:
                stream.writable()
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_handle = None
        self._flush()

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._unflushed = 0
        self._fresh.clear()
        data = self.h2.data_to_send()
        transport = self.transport
        if data and transport is not None and not transport.is_closing():
            transport.write(data)

    def _arm_idle_timer(self, timeout_s: float | None = None) -> None:
        """Close a connection without streams after uvicorn's keep-alive timeout, as HTTP/1.1 does
        (``timeout_s``: the head timeout instead, for a new connection's first request)."""
        timeout_s = self.idle_timeout_s if timeout_s is None else timeout_s
        if timeout_s > 0 and self._idle_timer is None:
            self._idle_timer = self.loop.call_later(timeout_s, self._idle)

    def _idle(self) -> None:
        self._idle_timer = None
        if not self.streams:
            self._close_gracefully()

    def _reset(self, sid: int, code: ErrorCodes) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.reset_stream(sid, code)  # (already closed if the client reset it in the same read)

    def _refuse(self, sid: int, status: int, message: str) -> None:
        """Answer a request the gateway will not serve with an OpenAI error, on its stream."""
        body = error_json(message, "request_header_fields_too_large")
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.send_headers(
                sid,
                [
                    (b":status", b"%d" % status),
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)),
                ],
            )
            self.h2.send_data(sid, body, end_stream=True)
            if not self.h2.streams[sid].closed:
                self.h2.reset_stream(sid, ErrorCodes.NO_ERROR)  # the rest of the request is not wanted
        if self.guard.refused():
            self._calm()

    def _calm(self) -> None:
        """Cut off an abusive connection: GOAWAY ENHANCE_YOUR_CALM, its streams lost, the transport
        closed (aborted if the client is not reading what is already queued)."""
        logger.warning("HTTP/2 client %s cut off: %s", self.client, self.guard.reason)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
        self._hang_up()

    def _hang_up(self) -> None:
        """After a GOAWAY for an error: send it, then close without losing it. Closing a socket with
        unread input makes the kernel send RST, and the client may never see the GOAWAY; so the write
        side is shut (FIN) and input is read and dropped for ``LINGER_S`` first, as nginx's lingering
        close does. A client that is not reading gets no such courtesy: the connection is aborted."""
        self.cut_off = True
        self._lose_all()
        self._flush()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():
            transport.abort()
            return
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)

    def _write_stalled(self) -> None:
        """The transport stayed above its high-water mark ``send_stall_s``: the client stopped reading."""
        self._write_stall_timer = None
        logger.info("HTTP/2 client %s stopped reading; connection aborted", self.client)
        self._lose_all()
        if self.transport is not None:
            self.transport.abort()

    def _lose_all(self) -> None:
        self._blocked.clear()
        self._write_waiters.clear()
        for stream in list(self.streams.values()):
            stream.lost()

    def _close_gracefully(self) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection()
        self._flush()
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
