"""The relay's HTTP/2 splice: after the first token, pod body chunks go from the pod connection's
parser callback to the stream's connection (``AsgiStream.writer``), not through an ASGI ``send`` each.

What it must keep: every byte, in order, however small the client's flow-control windows (a chunk
that arrives while earlier ones wait for the window queues behind them, and reading from the pod
pauses); the HTTP/1.1 splice under uvicorn; ASGI sends for HTTP/3. A client that resets, leaves or
stops reading: tests/test_h2_server.py, tests/test_h2_limits.py, tests/test_disconnects.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.procs import GatewayProcess
from tests.conftest import Fleet
from tests.test_h2_server import CHAT, RawH2, _sse_text, client_context, tls_gateway
from transports.asgi_stream import AsgiStream
from transports.client_socket import client_socket


@pytest.fixture(scope="module")
def gateway(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, int, Path]]:
    with tls_gateway(fleet, tmp_path_factory.mktemp("gw-splice"), h3=False) as running:
        yield running


ANSWER = {**CHAT, "max_tokens": 150, "ignore_eos": True}


async def _answers(port: int, cert: Path, window: int, streams: int) -> list[bytes]:
    client = await RawH2.open(port, tls=client_context(cert, ["h2"]), window=window)
    try:
        sids = [client.chat(json.dumps(ANSWER).encode()) for _ in range(streams)]
        await client.pump_until(lambda: all(s in client.ended for s in sids), timeout_s=30)
        assert all(client.status[s] == 200 for s in sids)
        return [bytes(client.body[s]) for s in sids]
    finally:
        client.close()


async def test_tiny_windows_keep_the_spliced_body_whole_and_in_order(
    gateway: tuple[GatewayProcess, int, Path],
) -> None:
    _, port, cert = gateway
    (roomy,) = await _answers(port, cert, 1 << 20, 1)
    text = _sse_text(roomy)
    assert text and roomy.count(b"data: ") == 150 + 2  # a role chunk, 150 tokens... and [DONE]
    # a 100-byte stream window (less than one token event): the gateway waits on nearly every chunk;
    # six streams on one connection also share its window
    narrow = await _answers(port, cert, 100, 6)
    assert [_sse_text(body) for body in narrow] == [text] * 6  # podsim's answers are deterministic


class _Conn:
    """Stands in for a connection without the splice (HTTP/3's)."""

    def send_data(self, stream: AsgiStream, data: bytes, end_stream: bool) -> bool:
        return True


class _SplicingConn(_Conn):
    splices = True

    def send_headers(self, stream: AsgiStream, headers: Any, end_stream: bool) -> None:
        pass


async def test_the_splice_is_offered_by_h2_streams_once_the_response_started() -> None:
    h2_stream = AsgiStream(_SplicingConn(), 1, {})  # type: ignore[arg-type]
    assert client_socket(h2_stream.send) is None  # no response yet: nothing to splice into
    await h2_stream.send({"type": "http.response.start", "status": 200, "headers": []})
    assert client_socket(h2_stream.send) is h2_stream
    h2_stream.lost()
    assert client_socket(h2_stream.send) is None
    h3_stream = AsgiStream(_Conn(), 0, {})  # type: ignore[arg-type]
    h3_stream.started = True
    assert client_socket(h3_stream.send) is None  # HTTP/3: one ASGI send per pod read

    async def wrapped(message: dict[str, Any]) -> None:
        await h2_stream.send(message)

    assert client_socket(wrapped) is None  # a send someone wrapped (gRPC-Web): ASGI sends


async def test_a_spliced_chunk_the_window_holds_back_pauses_the_pod_until_there_is_room() -> None:
    class Held(_SplicingConn):
        room = False

        def send_data(self, stream: AsgiStream, data: bytes, end_stream: bool) -> bool:
            sent.append(data)
            return self.room

    class Pod:
        def __init__(self) -> None:
            self.reading, self.closed = True, False

        def pause_reading(self) -> None:
            self.reading = False

        def resume_reading(self) -> None:
            self.reading = True

        def close(self) -> None:
            self.closed = True

    sent: list[bytes] = []
    conn = Held()
    stream = AsgiStream(conn, 1, {}, stall_s=30)  # type: ignore[arg-type]
    await stream.send({"type": "http.response.start", "status": 200, "headers": []})
    pod = Pod()
    sink = stream.writer(pod)
    sink(b"a")
    sink(b"b")  # the rest of the same pod read: handed on (the connection queues it), still paused
    assert sent == [b"a", b"b"] and not pod.reading
    stream.writable()  # the window opened and everything went out
    await asyncio.sleep(0)
    assert pod.reading
    stream.lost()  # the client left: the next chunk closes the pod answer instead of being sent
    sink(b"c")
    assert pod.closed and sent == [b"a", b"b"]
