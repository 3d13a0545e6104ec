"""Slow, abusive and malformed HTTP/1.1 clients against a real gateway process (short limits).

Each attack comes from ``loadtest.attacks.h1`` over plain sockets; each test checks what the server
answered (408 / 414 / 431 / 400 and a closed connection), that the pod never saw the attacking
requests (podsim's arrival log), that the gateway's memory stayed bounded (VmRSS), and, for the slow
attacks, that a well-behaved client on its own connection kept completing streams meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtest.attacks import h1
from loadtest.attacks.h2 import steady_streams
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import pod_arrivals

LIMITS = {
    "head_timeout_s": 1.0,
    "body_idle_timeout_s": 1.0,
    "body_timeout_s": 3.0,
    "keep_alive_timeout_s": 2.0,
}


@dataclass
class Target:
    pod: PodsimProcess
    gateway: GatewayProcess
    host: str
    port: int

    def arrivals(self) -> int:
        return pod_arrivals(self.pod.url)

    def rss_mb(self) -> float:
        return vm_rss_mb(self.gateway.pid)

    def cpu_s(self) -> float:
        """The gateway's CPU time so far (user + system)."""
        fields = Path(f"/proc/{self.gateway.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def limited_gateway(limits: dict[str, object], pod_args: list[str]) -> Iterator[Target]:
    with PodsimProcess(["--model", "llama-8b", *pod_args]) as pod:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False, "limits": limits},
            "pods": [{"name": "pod-a", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            host, port = gw.url.removeprefix("http://").rsplit(":", 1)
            yield Target(pod, gw, host, int(port))


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    yield from limited_gateway(LIMITS, ["--ttft-ms", "5", "--itl-ms", "2"])


async def _with_steady_client(target: Target, attack) -> tuple[object, object]:
    """Run ``attack`` while a well-behaved HTTP/1.1 client streams on its own connection."""
    stop = asyncio.Event()
    steady = asyncio.ensure_future(steady_streams(target.gateway.url, stop, http2=False))
    try:
        result = await attack
    finally:
        stop.set()
    return result, await steady


def _error_code(answer: bytes) -> str:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def test_slow_body_gets_408_at_the_body_deadline(target: Target) -> None:
    arrivals, rss = target.arrivals(), target.rss_mb()
    # a byte every 0.3 s never idles past 1 s, so the whole-body deadline (3 s) is what ends them
    report, steady = asyncio.run(_with_steady_client(
        target, h1.slow_body(target.host, target.port, connections=200, interval_s=0.3, duration_s=10)))
    assert report.connect_errors == 0
    assert report.statuses == {408: 200}, report.statuses
    assert report.closed == 200 and report.still_open == 0
    assert report.max_closed_after_s < 8  # 3 s deadline, generous margin for a loaded machine
    assert _error_code(report.bodies[0]) == "request_timeout"
    assert steady.failed == 0 and steady.completed >= 3
    assert target.arrivals() - arrivals == steady.completed  # no attacking request reached the pod
    assert target.rss_mb() - rss < 40


def test_stalled_body_gets_408_at_the_idle_deadline(target: Target) -> None:
    arrivals = target.arrivals()
    # one byte of body, then silence longer than the 1 s idle deadline
    report = asyncio.run(h1.slow_body(target.host, target.port, connections=50, interval_s=30, duration_s=8))
    assert report.statuses == {408: 50} and report.closed == 50
    assert report.max_closed_after_s < 2.9  # the idle deadline, before the 3 s whole-body one
    assert target.arrivals() == arrivals


def test_slow_headers_get_408_at_the_head_deadline(target: Target) -> None:
    arrivals, rss = target.arrivals(), target.rss_mb()
    report, steady = asyncio.run(_with_steady_client(
        target, h1.slow_headers(target.host, target.port, connections=200, interval_s=0.3, duration_s=8)))
    assert report.statuses == {408: 200}, report.statuses
    assert report.closed == 200 and report.max_closed_after_s < 6
    assert _error_code(report.bodies[0]) == "request_timeout"
    assert steady.failed == 0 and steady.completed >= 1
    assert target.arrivals() - arrivals == steady.completed
    assert target.rss_mb() - rss < 40


def test_slow_second_head_on_a_kept_alive_connection_gets_408(target: Target) -> None:
    """A connection that was answered once and then trickles its next head is held to the head
    deadline from that head's first byte (the keep-alive timer stops when bytes arrive)."""
    with socket.create_connection((target.host, target.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        first = _read_answer(sock)
        assert first.startswith(b"HTTP/1.1 200 ")
        time.sleep(0.5)  # the client pauses between requests (within the 2 s keep-alive timeout)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")  # and nothing more
        began = time.monotonic()
        second = _read_until_closed(sock)
        waited = time.monotonic() - began
    assert second.startswith(b"HTTP/1.1 408 "), second[:200]
    assert _error_code(second) == "request_timeout"
    # the 1 s head deadline from that head's first byte (not from the connection's start, nor from
    # the first request's), with a loaded machine's margin above (nothing else ends it)
    assert 0.9 <= waited < 6


def _read_answer(sock: socket.socket) -> bytes:
    """One answer with a Content-Length, read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += _recv(sock)
    return head + b"\r\n\r\n" + body


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise AssertionError("the gateway closed the connection before the answer's end")
    return data


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_silent_connections_are_closed(target: Target) -> None:
    report = asyncio.run(h1.idle_connections(target.host, target.port, connections=50, duration_s=6))
    assert report.closed == 50 and report.max_closed_after_s < 5
    assert report.statuses == {None: 50}  # nothing was asked, nothing is answered


def test_idle_keep_alive_connection_is_closed(target: Target) -> None:
    shot = h1.send_raw(target.host, target.port, b"GET /readyz HTTP/1.1\r\nHost: gw\r\n\r\n", timeout_s=10)
    assert shot.status == 200 and shot.closed
    assert 1.5 < shot.elapsed_s < 8  # the 2 s keep-alive timeout, not the 10 s read timeout


def test_oversized_heads_are_refused(target: Target) -> None:
    arrivals, rss = target.arrivals(), target.rss_mb()
    line = h1.long_request_line(target.host, target.port, 16 * 1024)
    assert (line.status, line.closed) == (414, True)
    assert _error_code(line.answer) == "uri_too_long"
    count = h1.many_headers(target.host, target.port, 101)
    assert (count.status, count.closed) == (431, True)
    assert _error_code(count.answer) == "request_header_fields_too_large"
    assert h1.many_headers(target.host, target.port, 90).status != 431  # under the default of 100
    big = h1.huge_header(target.host, target.port, 128 * 1024)
    assert (big.status, big.closed) == (431, True)
    # a header line that never ends, sent fast: cut off once it cannot fit, not buffered whole
    endless = h1.huge_header(target.host, target.port, 4 * 1024 * 1024)
    assert (endless.status, endless.closed) == (431, True)
    assert target.arrivals() == arrivals
    assert target.rss_mb() - rss < 40


@pytest.mark.parametrize("variant", sorted(h1.SMUGGLING))
def test_ambiguous_framing_is_refused(target: Target, variant: str) -> None:
    arrivals = target.arrivals()
    shot = h1.smuggle(target.host, target.port, variant)
    assert (shot.status, shot.closed) == (400, True), shot.answer[:200]
    assert len(re.findall(rb"HTTP/1\.1 \d{3} ", shot.answer)) == 1  # one answer: nothing smuggled behind it
    assert _error_code(shot.answer) == "invalid_request"
    assert target.arrivals() == arrivals
