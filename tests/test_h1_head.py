"""A streamed answer's head under uvicorn's HTTP/1.1 (``transports.client_socket.start_response``).

The gateway writes a streamed answer's status line and headers in uvicorn's stead, to skip uvicorn's
two regular expressions per header. These tests hold it to uvicorn itself: for the same messages the
client gets the same bytes, in one write, and uvicorn's request cycle is left in the state its own
``send`` would leave it in, so the response's end (still uvicorn's) frames and completes it. A
head uvicorn would refuse is still refused by uvicorn."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from transports.client_socket import start_response


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def _cycle(*, keep_alive: bool = True, method: str = "POST") -> tuple[RequestResponseCycle, _Transport]:
    transport = _Transport()
    scope: Any = {"type": "http", "method": method, "path": "/v1/chat/completions", "http_version": "1.1"}
    cycle = RequestResponseCycle(
        scope=scope,
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[(b"date", b"Fri, 27 Nov 2026 10:00:00 GMT")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    return cycle, transport


_STATE = (
    "response_started", "chunked_encoding", "expected_content_length", "keep_alive", "response_complete",
)


async def _both_ways(
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    *,
    keep_alive: bool = True,
    method: str = "POST",
    last: bytes = b"data: [DONE]\n\n",
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What the client receives, and the cycle's state after the end, via ``start_response`` and via
    uvicorn's own ``send`` alone."""
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    first = {"type": "http.response.body", "body": body, "more_body": True}
    end = {"type": "http.response.body", "body": last, "more_body": False}
    results = []
    for ours in (True, False):
        cycle, transport = _cycle(keep_alive=keep_alive, method=method)
        if ours:
            await start_response(cycle.send, start, first)
            writes_before_end = len(transport.writes)
        else:
            await cycle.send(start)
            await cycle.send(first)
            writes_before_end = 1
        await cycle.send(end)
        state = tuple(getattr(cycle, name) for name in _STATE)
        results.append((b"".join(transport.writes), writes_before_end, state, transport.closed))
    return results[0], results[1]


# What a header value may hold (RFC 9110 field-value: visible bytes, space, tab, obs-text)
_VALUE = st.binary(max_size=40).map(lambda v: bytes(b for b in v if b == 9 or 32 <= b != 127))
_NAME = st.sampled_from([b"x-request-id", b"x-sluicegate-pod", b"x-ratelimit-remaining-tokens", b"alt-svc"])


@settings(max_examples=60, deadline=None)
@given(headers=st.lists(st.tuples(_NAME, _VALUE), max_size=12), body=st.binary(max_size=64))
def test_a_streamed_head_is_what_uvicorn_writes_in_one_write(
    headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    headers = [(b"content-type", b"text/event-stream"), *headers]
    ours, uvicorns = asyncio.run(_both_ways(headers, body))
    wire, writes, state, closed = ours
    assert (wire, state, closed) == (uvicorns[0], uvicorns[2], uvicorns[3])
    assert writes == 1  # status line, headers and first chunk together
    assert wire.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked\r\n\r\n" in wire


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("method", ["POST", "HEAD"])
def test_connection_close_and_head_requests_frame_as_uvicorn_frames_them(
    keep_alive: bool, method: str
) -> None:
    headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"req-1")]
    ours, uvicorns = asyncio.run(_both_ways(headers, b"data: {}\n\n", keep_alive=keep_alive, method=method))
    assert (ours[0], ours[2], ours[3]) == (uvicorns[0], uvicorns[2], uvicorns[3])
    if not keep_alive:
        assert b"connection: close\r\n" in ours[0] and ours[3]  # said, and the connection closed after


@pytest.mark.parametrize(
    "header",
    [(b"content-length", b"11"), (b"connection", b"close"), (b"transfer-encoding", b"chunked")],
)
def test_a_head_that_decides_its_own_framing_is_left_to_uvicorn(header: tuple[bytes, bytes]) -> None:
    headers = [(b"content-type", b"text/event-stream"), header]
    body = b"data: {}\n\n\n"  # 11 bytes, as the content-length says
    ours, uvicorns = asyncio.run(_both_ways(headers, body, last=b""))
    assert (ours[0], ours[2], ours[3]) == (uvicorns[0], uvicorns[2], uvicorns[3])


@pytest.mark.parametrize("value", [b"a\r\nset-cookie: x=1", b"a\nb", b"a\rb", b"a\x00b", b"a\x7fb"])
def test_a_header_value_uvicorn_refuses_is_still_refused(value: bytes) -> None:
    """A value that would split the head (or carries a control byte) never reaches the client."""
    cycle, transport = _cycle()
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"text/event-stream"), (b"x-request-id", value)]}
    first = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
        asyncio.run(start_response(cycle.send, start, first))
    assert b"".join(transport.writes) == b""
