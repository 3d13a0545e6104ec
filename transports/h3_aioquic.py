"""Four changes to how aioquic (1.7) builds and paces packets (``apply()``, at listener start): same
frames, less work.

Measured with 50 streams of tokens on one connection (``loadtest/bench_transports``' h3 row),
aioquic spent most of the gateway's CPU not on packets but on looking for something to put in them
(the first three), or, once the connection was fast, on waking for packets its pacer held back (the
fourth):

- ``QuicStreamSender.buffer_is_empty`` is cleared only when ``get_frame`` is called and finds
  nothing, so every stream that sent leaves a stale flag, and the next packet of every transmit
  pays a wasted ``_write_stream_frame`` for it (two IndexErrors in ``next_offset``).
  ``_get_frame`` sets the flag as soon as a stream's last pending byte (and FIN) is out; lost data
  sets it again in ``on_data_delivery``, as before. Crypto streams (no id) are left alone.
- ``QuicConnection._write_application`` visits every stream twice per packet (MAX_STREAM_DATA, then
  the send queue), and once more for the empty packet that ends the loop: a transmit of 7 packets
  for 9 streams' tokens walked 50 streams 16 times. ``_write_application`` walks them once per
  call, and hands aioquic's own loop only the streams that can write something (a frame, a reset,
  STOP_SENDING, or a finished stream to discard) and those owed MAX_STREAM_DATA. The streams left
  out have nothing to send and keep their place ahead of those served (aioquic's round-robin puts
  served streams last). The finished streams it discards and those owed MAX_STREAM_DATA are the only
  ones it sees in ``_streams``, which it walks once a packet. Server connections only.
- Within that call, aioquic still offered every active stream to every packet: once a packet is
  full the rest of the walk finds no room (``_write_stream_frame``), so a transmit of P packets for
  N streams' tokens made ~N x P calls where ~N write (100,109 calls for 10,050 tokens, 50 streams,
  12 packets a transmit). ``_write_stream_frame`` now ends a full packet, and ``_write_application``
  calls aioquic's loop again for the next one, as its own loop would have gone on. One difference:
  a RESET_STREAM or STOP_SENDING due on a stream behind a full packet made aioquic end the whole
  transmit (its frame did not fit: ``QuicPacketBuilderStop``); it now goes in the next packet, and
  the transmit goes on. Finished streams behind a full packet are discarded a packet later.

- The pacer's burst shrank as a connection's congestion window grew. aioquic sizes its token bucket
  as a burst of packets (16, or a quarter of the window) at the pacing rate (the window over the
  RTT), but never lets one packet's time fall below 1 µs. Past a packet a microsecond (~1.2 GB/s,
  which a loopback or LAN connection reaches once its window passes a few MB at a 1-2 ms RTT) the
  bucket held fewer and fewer packets, so every transmit stopped after a few and woke again on the
  pacing timer: on one HTTP/3 connection carrying load after load, the gateway's CPU per token
  tripled within four loads of 50 streams (23 -> 66 CPU-ms per 1000 tokens; 6 packets a burst at a
  5 MB window). The bucket now holds its burst of packets at the clamped packet time; below the
  clamp nothing changes.

All four are checked by tests/test_h3_aioquic.py against aioquic's own behaviour: the same bytes
delivered on every stream, as many datagrams as full, the same datagrams when the congestion window
leaves no room, as many packets, as full, when the pacer lets five go, and the same bucket as
aioquic's below the clamp, its full burst above it.
"""

from __future__ import annotations

from typing import Any

from aioquic.quic.connection import QuicConnection, QuicNetworkPath
from aioquic.quic.crypto import NoCallback
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.quic.stream import QuicStream, QuicStreamFrame, QuicStreamSender

_aioquic_get_frame = QuicStreamSender.get_frame
_aioquic_write_application = QuicConnection._write_application
_aioquic_write_stream_frame = QuicConnection._write_stream_frame
_aioquic_update_rate = QuicPacketPacer.update_rate

SCAN_ABOVE = 8  # streams: below this aioquic's own per-packet walk is as cheap as ours


def _get_frame(
    self: QuicStreamSender, max_size: int, max_offset: int | None = None
) -> QuicStreamFrame | None:
    frame = _aioquic_get_frame(self, max_size, max_offset)
    if frame is not None and self._stream_id is not None and not self._pending_eof and not len(self._pending):
        self.buffer_is_empty = True
    return frame


class _PacketFull(Exception):
    """A packet has no room left for any stream frame (see ``_write_stream_frame``)."""


# The smallest STREAM frame: type, a 1-byte stream id, the 2-byte length aioquic always writes,
# and one byte of data. With less room than this left in a packet no stream can add to it.
_MIN_STREAM_FRAME = 5


def _write_stream_frame(self: QuicConnection, builder: QuicPacketBuilder, *args: Any, **kwargs: Any) -> int:
    """aioquic's, but during ``_write_application`` below it ends a packet that is full.

    aioquic's packet loop offers every stream with data to every packet: once a packet is full
    the rest of the walk writes nothing (``get_frame`` finds no room), so a transmit of P packets
    for N streams made N x P calls where ~N write. An empty packet is never ended this way (the
    congestion window may leave no room in a fresh one; aioquic's own loop then stops), so every
    raise follows a packet that goes out, and the loop below makes progress."""
    stop = self._stop_when_full  # first: most calls (clients, small connections) end the test here
    if stop and builder.remaining_flight_space < _MIN_STREAM_FRAME and not builder.packet_is_empty:
        raise _PacketFull
    return _aioquic_write_stream_frame(self, builder, *args, **kwargs)


def _owes_limits(stream: QuicStream) -> bool:
    """Whether aioquic's ``_write_stream_limits`` would raise or send this stream's MAX_STREAM_DATA."""
    local = stream.max_stream_data_local
    if local and stream.receiver.highest_offset * 2 > local:
        return True
    return stream.max_stream_data_local_sent != local


def _write_application(
    self: QuicConnection, builder: QuicPacketBuilder, network_path: QuicNetworkPath, now: float
) -> None:
    streams: dict[int, QuicStream] = self._streams
    if self._is_client or len(streams) < SCAN_ABOVE:
        _aioquic_write_application(self, builder, network_path, now)
        return
    idle: list[QuicStream] = []
    active: list[QuicStream] = []
    finished: list[QuicStream] = []
    for stream in self._streams_queue:
        sender = stream.sender
        if stream.is_finished:
            finished.append(stream)
            active.append(stream)
        elif sender.buffer_is_empty and not sender.reset_pending and not stream.receiver.stop_pending:
            idle.append(stream)
        else:
            active.append(stream)
    # aioquic reads self._streams for MAX_STREAM_DATA, once a packet, and pops the finished streams
    # it discards from it: those are all it needs to see
    listed: dict[int, QuicStream] = {s.stream_id: s for s in streams.values() if _owes_limits(s)}
    for stream in finished:
        listed[stream.stream_id] = stream
    self._streams, self._streams_queue = listed, active
    self._stop_when_full = True
    try:
        while True:
            try:
                _aioquic_write_application(self, builder, network_path, now)
                break
            except _PacketFull:
                # the packet is full: what aioquic's own loop does after a non-empty packet, then
                # on to the next one, without walking the streams that cannot fit in this one
                self._loss._pacer.update_after_send(now=now)
    finally:
        self._stop_when_full = False
        served = self._streams_queue
        for stream in finished:
            if stream.stream_id not in listed:  # discarded by aioquic
                streams.pop(stream.stream_id, None)
        self._streams = streams
        self._streams_queue = idle + served if idle else served


def _update_rate(self: QuicPacketPacer, congestion_window: int, smoothed_rtt: float) -> None:
    """aioquic's, with a bucket that holds aioquic's burst of packets at the packet time it set."""
    _aioquic_update_rate(self, congestion_window, smoothed_rtt)
    size = self._max_datagram_size
    burst = max(2 * size, min(congestion_window // 4, 16 * size)) // size  # packets, as aioquic's
    least = burst * (self.packet_time or 0.0)
    if self.bucket_max < least:
        self.bucket_max = least


def ignore(*args: Any) -> None:
    """A callback that does nothing: what ``release`` leaves in place of one to the connection."""


def release(quic: QuicConnection) -> None:
    """Let go of a terminated connection's callbacks to itself.

    aioquic keeps them on the connection and its parts: the frame handlers (a dict of bound
    methods), the loss recovery's probe, the TLS context's ALPN and traffic-key callbacks, each
    crypto context's key-log partials. So every connection is a cycle (~350 objects, ~50 KB), left
    for a collection of the generation it reached. Called once ``ConnectionTerminated`` arrives:
    a terminated connection handles no datagram again and sets no timer."""
    handlers = getattr(quic, "_QuicConnection__frame_handlers", None)
    if isinstance(handlers, dict):
        handlers.clear()
    loss = getattr(quic, "_loss", None)
    if loss is not None and hasattr(loss, "_send_probe"):
        loss._send_probe = ignore
    tls_context = getattr(quic, "tls", None)
    if tls_context is not None:
        tls_context.alpn_cb = None
        tls_context.update_traffic_key_cb = ignore
    for pairs in (getattr(quic, "_cryptos", None), getattr(quic, "_cryptos_initial", None)):
        for pair in (pairs or {}).values():
            for context in (pair.recv, pair.send):
                context._setup_cb = context._teardown_cb = NoCallback


def apply() -> None:
    """Install the four (idempotent; process-wide, which a gateway process wants)."""
    QuicStreamSender.get_frame = _get_frame  # type: ignore[method-assign]
    QuicPacketPacer.update_rate = _update_rate  # type: ignore[method-assign]
    QuicConnection._write_application = _write_application  # type: ignore[method-assign]
    QuicConnection._write_stream_frame = _write_stream_frame  # type: ignore[method-assign]
    QuicConnection._stop_when_full = False  # type: ignore[attr-defined]

