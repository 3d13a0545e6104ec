"""HTTP/3 clients on aioquic that misbehave the way attackers (or some browsers) do, each returning what
it observed. Meant for 127.0.0.1 and a gateway you run yourself; certificates are not verified.

- ``early_answer_upload``: not an attack; a client modelled on Chromium 156 uploading a large body
  to a request the server answers early (413, gRPC error). It reports whether Chromium would have
  shown the answer: it fails a request whose response is reset, whose upload is stopped with an
  error other than H3_NO_ERROR, or whose upload is stopped (even with H3_NO_ERROR) while one of its
  writes waits for flow-control credit (quic_chromium_client_stream.cc: that write's callback only
  runs when the stream closes, with ERR_QUIC_PROTOCOL_ERROR since the client's FIN was never sent).
- ``stream_flood``: request streams opened as fast as the QUIC limit allows, each cancelled at once
  (HTTP/2's rapid reset, in HTTP/3): the stream credit comes back before the server's work is done.
- ``initial_flood``: one real ClientHello from each of ``count`` source ports, never continued.
- ``half_open``: the same, but each client keeps listening (see its doc for what it can see).
- ``crypto_offset``: one forged Initial whose CRYPTO frame claims a far offset.
- ``never_reading``: a request whose response the client never grants flow-control credit for
  (it still acknowledges packets, so the connection stays alive).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import os
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StopSendingReceived, StreamReset
from aioquic.quic.packet import QuicFrameType, QuicPacketType, QuicProtocolVersion
from aioquic.quic.packet_builder import QuicPacketBuilder

H3_NO_ERROR = int(ErrorCode.H3_NO_ERROR)
H3_REQUEST_REJECTED = int(ErrorCode.H3_REQUEST_REJECTED)
H3_REQUEST_CANCELLED = int(ErrorCode.H3_REQUEST_CANCELLED)
CHAT = b'{"model":"llama-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"stream":true}'
MAX_FLOOD = 10_000  # the most sockets or streams one call may use


def _loopback(host: str) -> None:
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"attack clients only target loopback addresses, not {host!r}")


def _configuration(**kwargs: Any) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=H3_ALPN, server_name="localhost", verify_mode=ssl.CERT_NONE, **kwargs
    )
    return configuration


def request_headers(path: str, method: bytes = b"POST", extra: list[tuple[bytes, bytes]] | None = None
                    ) -> list[tuple[bytes, bytes]]:  # fmt: skip
    return [(b":method", method), (b":scheme", b"https"), (b":authority", b"localhost"),
            (b":path", path.encode()), *(extra or [])]  # fmt: skip


@dataclass
class StreamView:
    """What one request stream saw from the server."""

    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False  # the response's FIN arrived
    reset_code: int | None = None  # the server reset its response (RESET_STREAM)
    stop_code: int | None = None  # the server asked us to stop uploading (STOP_SENDING)
    stop_while_writing: bool = False  # ... while some of our upload was still waiting to be sent
    started_at: float = field(default_factory=time.monotonic)
    first_byte_after_s: float | None = None
    ended_after_s: float | None = None
    reset_after_s: float | None = None


class H3Peer(QuicConnectionProtocol):
    """One QUIC connection; records what the server does to each stream it opened."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.streams: dict[int, StreamView] = {}
        self.changed = asyncio.Event()
        self.terminated: ConnectionTerminated | None = None

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        self.changed.set()  # acknowledgements and flow-control credit raise no event of their own

    def withhold_credit(self) -> None:
        """Never raise a flow-control limit again (MAX_DATA, MAX_STREAM_DATA); ACKs still go out."""
        quic = self._quic
        quic._write_connection_limits = lambda **_: None  # type: ignore[method-assign]
        quic._write_stream_limits = lambda **_: None  # type: ignore[method-assign]

    def request(self, headers: list[tuple[bytes, bytes]], body: bytes = b"", end: bool = True) -> int:
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, headers, end_stream=end and not body)
        if body:
            self.h3.send_data(sid, body, end_stream=end)
        self.streams[sid] = StreamView()
        self.transmit()
        return sid

    def unsent(self, sid: int) -> int:
        """Bytes we wrote to the stream that are not yet in a packet (flow control holds them)."""
        stream = self._quic._streams.get(sid)
        return 0 if stream is None else stream.sender._buffer_stop - stream.sender.highest_offset

    def delivered(self, sid: int) -> bool:
        """Whether the server acknowledged every byte we wrote to the stream, its end included (a
        finished stream aioquic has already discarded counts as delivered)."""
        stream = self._quic._streams.get(sid)
        return stream is None or stream.sender.is_finished

    def headers_sent(self, sid: int) -> bool:
        stream = self._quic._streams.get(sid)
        return stream is not None and not stream.is_blocked and stream.sender.highest_offset > 0

    def quic_event_received(self, event: QuicEvent) -> None:
        now = time.monotonic()
        if isinstance(event, StopSendingReceived) and event.stream_id in self.streams:
            view = self.streams[event.stream_id]
            view.stop_code = event.error_code
            view.stop_while_writing = self.unsent(event.stream_id) > 0
        elif isinstance(event, StreamReset) and event.stream_id in self.streams:
            view = self.streams[event.stream_id]
            view.reset_code = event.error_code
            view.reset_after_s = now - view.started_at
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event
        for h3_event in self.h3.handle_event(event):
            view = self.streams.get(getattr(h3_event, "stream_id", -1))  # type: ignore[assignment]
            if view is None:
                continue
            if isinstance(h3_event, HeadersReceived) and not view.status:
                view.headers = dict(h3_event.headers)
                view.status = int(view.headers.get(b":status", b"0"))
                view.first_byte_after_s = now - view.started_at
            elif isinstance(h3_event, DataReceived):
                view.body += h3_event.data
            if getattr(h3_event, "stream_ended", False):
                view.ended = True
                view.ended_after_s = now - view.started_at
        self.changed.set()

    async def until(self, done: Any, timeout_s: float) -> bool:
        """Wait until ``done()`` (or the connection ends, or the time is up); returns ``done()``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not done() and self.terminated is None:
                    self.changed.clear()
                    await self.changed.wait()
        return bool(done())


@contextlib.asynccontextmanager
async def h3_peer(host: str, port: int, **configuration: Any) -> AsyncIterator[H3Peer]:
    _loopback(host)
    async with connect(
        host, port, configuration=_configuration(**configuration), create_protocol=H3Peer, wait_connected=True
    ) as peer:
        assert isinstance(peer, H3Peer)
        yield peer


# -- a Chromium-like upload that the server answers early ---------------------------------------


@dataclass
class EarlyAnswerReport:
    view: StreamView
    uploaded: int = 0  # body bytes handed to QUIC
    upload_finished: bool = False  # our FIN went out: the whole body was accepted
    chromium_ok: bool = False  # whether Chromium would show the response (see the module doc)


async def early_answer_upload(
    host: str,
    port: int,
    *,
    path: str,
    body_size: int,
    headers: list[tuple[bytes, bytes]] | None = None,
    first: bytes = b"",
    piece: int = 64 * 1024,
    ahead: int = 256 * 1024,
    timeout_s: float = 20.0,
) -> EarlyAnswerReport:
    """POST ``first`` then filler up to ``body_size`` bytes, in ``piece``-sized writes, never more
    than ``ahead`` bytes waiting for credit (a browser's upload buffer), until done or stopped."""
    async with h3_peer(host, port) as peer:
        sid = peer.request(request_headers(path, extra=headers), end=False)
        view = peer.streams[sid]
        report = EarlyAnswerReport(view)
        deadline = time.monotonic() + timeout_s
        while report.uploaded < body_size and view.stop_code is None and view.reset_code is None:
            if peer.terminated is not None or time.monotonic() > deadline:
                break
            if peer.unsent(sid) >= ahead:
                await peer.until(lambda: peer.unsent(sid) < ahead or view.stop_code is not None, 1.0)
                continue
            size = min(piece, body_size - report.uploaded)
            chunk = first[report.uploaded : report.uploaded + size]
            chunk += b" " * (size - len(chunk))
            report.uploaded += size
            peer.h3.send_data(sid, chunk, end_stream=report.uploaded >= body_size)
            peer.transmit()
            await asyncio.sleep(0)  # let acknowledgements and the answer in
        report.upload_finished = report.uploaded >= body_size and view.stop_code is None
        if report.upload_finished:
            # Chromium reads the response once its upload is done: wait for our last byte to be
            # acknowledged (out is not enough: a datagram lost on a loaded loopback would never be
            # sent again once we close, and the server would wait for the body's end forever)
            left = deadline - time.monotonic()
            await peer.until(lambda: peer.delivered(sid) or view.stop_code is not None, left)
            report.upload_finished = view.stop_code is None or not view.stop_while_writing
        left = max(0.1, deadline - time.monotonic())
        await peer.until(lambda: view.ended or view.reset_code is not None, left)
        stop = view.stop_code
        stopped_badly = stop is not None and (stop != H3_NO_ERROR or view.stop_while_writing)
        report.chromium_ok = view.ended and view.reset_code is None and not stopped_badly
        return report


# -- many streams, each cancelled at once --------------------------------------------------------


@dataclass
class StreamFloodReport:
    opened: int = 0
    answered: int = 0  # a response's HEADERS arrived before the cancel took effect
    rejected: int = 0  # the server refused it: H3_REQUEST_REJECTED
    resets: Counter[int] = field(default_factory=Counter)  # RESET_STREAM codes from the server
    stops: Counter[int] = field(default_factory=Counter)  # STOP_SENDING codes from the server
    closed_code: int | None = None  # the server closed the connection with this code


async def stream_flood(
    host: str,
    port: int,
    *,
    streams: int,
    path: str = "/v1/chat/completions",
    body: bytes = CHAT % 200,
    cancel: bool = True,
    timeout_s: float = 10.0,
) -> StreamFloodReport:
    """Open ``streams`` requests (each with its body and FIN) as fast as stream credit comes; with
    ``cancel``, STOP_SENDING (H3_REQUEST_CANCELLED) each as soon as its HEADERS have left, in a
    later packet so the server has seen the request first."""
    if streams > MAX_FLOOD:
        raise ValueError(f"at most {MAX_FLOOD} streams")
    report = StreamFloodReport()
    headers = request_headers(path, extra=[(b"content-type", b"application/json")])
    async with h3_peer(host, port) as peer:
        waiting: list[int] = []
        deadline = time.monotonic() + timeout_s
        while (report.opened < streams or waiting) and peer.terminated is None:
            if time.monotonic() > deadline:
                break
            while report.opened < streams and len(waiting) < 64:
                waiting.append(peer.request(headers, body))
                report.opened += 1
            if cancel:
                for sid in [s for s in waiting if peer.headers_sent(s)]:
                    waiting.remove(sid)
                    with contextlib.suppress(ValueError):
                        peer._quic.stop_stream(sid, H3_REQUEST_CANCELLED)
                peer.transmit()
            else:
                waiting = [s for s in waiting if not peer.headers_sent(s)]
            await peer.until(functools.partial(_any_sent, peer, list(waiting)), 0.2)
        await peer.until(
            lambda: all(v.reset_code is not None or v.ended for v in peer.streams.values()), 2.0
        )
        for view in peer.streams.values():
            if view.status:
                report.answered += 1
            if view.reset_code is not None:
                report.resets[view.reset_code] += 1
            if view.stop_code is not None:
                report.stops[view.stop_code] += 1
            if H3_REQUEST_REJECTED in (view.reset_code, view.stop_code):
                report.rejected += 1
        if peer.terminated is not None:
            report.closed_code = peer.terminated.error_code
    return report


def _any_sent(peer: H3Peer, sids: list[int]) -> bool:
    return any(peer.headers_sent(s) for s in sids)


# -- Initials from many source ports -------------------------------------------------------------


class _Socket(asyncio.DatagramProtocol):
    """One source port: the client connection whose Initial it sent, and what came back."""

    def __init__(self, quic: QuicConnection, listen: bool) -> None:
        self.quic = quic
        self.listen = listen
        self.first_reply: int | None = None  # the first reply's long-header packet type
        self.terminated: ConnectionTerminated | None = None
        self.terminated_at: float | None = None

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.first_reply is None and data:
            self.first_reply = (data[0] & 0x30) >> 4 if data[0] & 0x80 else -1
        if self.listen and self.terminated is None:
            self.quic.receive_datagram(data, addr, now=time.monotonic())
            event = self.quic.next_event()
            while event is not None:
                if isinstance(event, ConnectionTerminated):
                    self.terminated, self.terminated_at = event, time.monotonic()
                event = self.quic.next_event()


RETRY = 3  # long-header packet type of a Retry (RFC 9000 section 17.2)
INITIAL = 0


@dataclass
class InitialFloodReport:
    sent: int = 0
    answered: int = 0  # the server answered with its Initial: a handshake (and state) began
    retried: int = 0  # the server answered with a Retry: no state kept until the address is proven
    unanswered: int = 0
    closed_by_server: int = 0  # (half_open) the server sent CONNECTION_CLOSE
    close_codes: Counter[int] = field(default_factory=Counter)
    closed_after_s: list[float] = field(default_factory=list)


async def initial_flood(host: str, port: int, *, count: int, wait_s: float = 1.0) -> InitialFloodReport:
    """One real Initial (ClientHello) from each of ``count`` fresh UDP ports; nothing more is sent.
    Counts how the server answered each within ``wait_s``."""
    return await _initials(host, port, count=count, wait_s=wait_s, listen=False)


async def half_open(host: str, port: int, *, count: int, wait_s: float) -> InitialFloodReport:
    """``initial_flood``, but each client processes what the server sends (never answering it) for
    ``wait_s``, noting a CONNECTION_CLOSE it can decrypt. Expect none even when the server gives
    the handshake up: its first flight has used most of what the anti-amplification limit lets it
    send to an unvalidated address, so its close usually cannot go out. The server's own counters
    are the measure of reclamation."""
    return await _initials(host, port, count=count, wait_s=wait_s, listen=True)


async def _initials(host: str, port: int, *, count: int, wait_s: float, listen: bool) -> InitialFloodReport:
    _loopback(host)
    if count > MAX_FLOOD:
        raise ValueError(f"at most {MAX_FLOOD} source ports")
    loop = asyncio.get_running_loop()
    report = InitialFloodReport()
    sockets: list[tuple[asyncio.DatagramTransport, _Socket]] = []
    started = time.monotonic()
    try:
        for _ in range(count):
            quic = QuicConnection(configuration=_configuration())
            quic.connect((host, port), now=time.monotonic())
            transport, proto = await loop.create_datagram_endpoint(
                lambda q=quic: _Socket(q, listen), local_addr=(host, 0)
            )
            sockets.append((transport, proto))
            for data, _ in quic.datagrams_to_send(now=time.monotonic()):
                transport.sendto(data, (host, port))
            report.sent += 1
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if listen and all(p.terminated is not None for _, p in sockets):
                break
            await asyncio.sleep(0.05)
    finally:
        for transport, proto in sockets:
            transport.close()
            if proto.first_reply == RETRY:
                report.retried += 1
            elif proto.first_reply is None:
                report.unanswered += 1
            else:
                report.answered += 1
            if proto.terminated is not None and proto.terminated_at is not None:
                report.closed_by_server += 1
                report.close_codes[proto.terminated.error_code] += 1
                report.closed_after_s.append(proto.terminated_at - started)
    return report


# -- a CRYPTO frame claiming a far offset -------------------------------------------------------


async def crypto_offset(host: str, port: int, *, offset: int, size: int = 64) -> int:
    """One client Initial (padded to 1200 bytes) whose only frame is CRYPTO data at ``offset``: a
    server buffers CRYPTO data out of order up to the highest offset it accepts. Returns the bytes
    sent; what the server did is for its own counters to say."""
    _loopback(host)
    dcid, scid = os.urandom(8), os.urandom(8)
    crypto = CryptoPair()
    crypto.setup_initial(cid=dcid, is_client=True, version=QuicProtocolVersion.VERSION_1)
    builder = QuicPacketBuilder(
        host_cid=scid, peer_cid=dcid, version=QuicProtocolVersion.VERSION_1, is_client=True,
        max_datagram_size=1200,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(QuicFrameType.CRYPTO)
    buf.push_uint_var(offset)
    buf.push_uint_var(size)
    buf.push_bytes(os.urandom(size))
    datagrams, _ = builder.flush()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=(host, 0))
    try:
        for datagram in datagrams:
            transport.sendto(datagram, (host, port))
    finally:
        transport.close()
    return sum(len(d) for d in datagrams)


# -- a client that never grants credit -----------------------------------------------------------


@dataclass
class NeverReadingReport:
    view: StreamView
    received: int = 0  # response bytes that arrived (at most what our windows allowed)
    closed_code: int | None = None  # the server closed the whole connection with this code


async def never_reading(
    host: str,
    port: int,
    *,
    path: str = "/v1/chat/completions",
    body: bytes = CHAT % 4000,
    headers: list[tuple[bytes, bytes]] | None = None,
    window: int = 16 * 1024,
    timeout_s: float = 30.0,
) -> NeverReadingReport:
    """A streaming request on a connection whose windows (``window`` per stream, twice that in all)
    are never raised; waits until the server resets the stream or closes, or ``timeout_s``."""
    extra = [(b"content-type", b"application/json"), *(headers or [])]
    async with h3_peer(host, port, max_stream_data=window, max_data=2 * window) as peer:
        peer.withhold_credit()
        sid = peer.request(request_headers(path, extra=extra), body)
        view = peer.streams[sid]
        await peer.until(lambda: view.reset_code is not None or view.ended, timeout_s)
        closed = peer.terminated.error_code if peer.terminated is not None else None
        return NeverReadingReport(view, len(view.body), closed)
