"""Two changes to how aioquic (1.7) builds packets (``apply()``, at listener start): same frames, fewer scans.

Measured with 50 streams of tokens on one connection (``loadtest/bench_transports``' h3 row),
aioquic spent most of the gateway's CPU not on packets but on looking for something to put in them:

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
  served streams last). Server connections only.

Both are checked by tests/test_h3_aioquic.py against aioquic's own behaviour.
"""

from __future__ import annotations

from aioquic.quic.connection import QuicConnection, QuicNetworkPath
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.stream import QuicStream, QuicStreamFrame, QuicStreamSender

_aioquic_get_frame = QuicStreamSender.get_frame
_aioquic_write_application = QuicConnection._write_application

SCAN_ABOVE = 8  # streams: below this aioquic's own per-packet walk is as cheap as ours


def _get_frame(
    self: QuicStreamSender, max_size: int, max_offset: int | None = None
) -> QuicStreamFrame | None:
    frame = _aioquic_get_frame(self, max_size, max_offset)
    if frame is not None and self._stream_id is not None and not self._pending_eof and not len(self._pending):
        self.buffer_is_empty = True
    return frame


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
    queue = self._streams_queue
    idle: list[QuicStream] = []
    active: list[QuicStream] = []
    for stream in queue:
        sender = stream.sender
        if (
            sender.buffer_is_empty
            and not sender.reset_pending
            and not stream.receiver.stop_pending
            and not stream.is_finished
        ):
            idle.append(stream)
        else:
            active.append(stream)
    # aioquic reads self._streams for MAX_STREAM_DATA and pops discarded (finished) streams from it
    listed: dict[int, QuicStream] = {s.stream_id: s for s in streams.values() if _owes_limits(s)}
    for stream in active:
        listed[stream.stream_id] = stream
    self._streams, self._streams_queue = listed, active
    try:
        _aioquic_write_application(self, builder, network_path, now)
    finally:
        served = self._streams_queue
        for stream in active:
            if stream.stream_id not in listed:  # discarded by aioquic
                streams.pop(stream.stream_id, None)
        self._streams = streams
        self._streams_queue = idle + served if idle else served


def apply() -> None:
    """Install both (idempotent; process-wide, which a gateway process wants)."""
    QuicStreamSender.get_frame = _get_frame  # type: ignore[method-assign]
    QuicConnection._write_application = _write_application  # type: ignore[method-assign]

