"""HTTP/3 listener (QUIC on UDP, aioquic's H3Connection), over real sockets.

The same two servers as tests/test_h2_server.py: the in-process SSE app (ASGI contract:
disconnects on STOP_SENDING, RESET_STREAM, connection close and idle timeout; back-pressure; many
streams) and a real gateway process before the pod simulator (a client leaving aborts the pod's
generation). The client is a minimal one on aioquic, below: it can cancel streams either way,
close the connection, or go silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from loadtest.procs import GatewayProcess
from tests.conftest import Fleet, wait_for
from tests.test_h2_server import (
    CHAT,
    DONE,
    LONG,
    RawH2,
    Running,
    _sse_text,
    aborted,
    client_context,
    server_garbage,
    serving,
    tls_gateway,
)
from transports import h3_server
from transports.stream_starts import StreamStarts

# -- a minimal HTTP/3 client -------------------------------------------------------------------


class H3Response:
    def __init__(self, client: H3Client, stream_id: int) -> None:
        self.client = client
        self.stream_id = stream_id
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.ended = False
        self.reset_code: int | None = None
        self.changed = asyncio.Event()

    async def until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                if self.client.terminated.is_set():
                    raise ConnectionError(f"connection closed: {self.client.close_event}")
                self.changed.clear()
                await self.changed.wait()


class H3Client(QuicConnectionProtocol):
    """Requests on one QUIC connection; can cancel a stream (STOP_SENDING / RESET_STREAM), close the
    connection, stop processing what arrives (``deaf``), or stop sending anything (``mute``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.responses: dict[int, H3Response] = {}
        self.terminated = asyncio.Event()
        self.close_event: ConnectionTerminated | None = None
        self.deaf = False
        self.mute = False

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if not self.deaf:
            super().datagram_received(data, addr)

    def transmit(self) -> None:
        if self.mute:
            self._transmit_task = None
            return
        super().transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            resp = self.responses.get(getattr(h3_event, "stream_id", -1))
            if resp is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                resp.headers = dict(h3_event.headers)
                resp.status = int(resp.headers.get(b":status", b"0"))
            elif isinstance(h3_event, DataReceived):
                resp.body += h3_event.data
            if getattr(h3_event, "stream_ended", False):
                resp.ended = True
            resp.changed.set()
        if isinstance(event, StreamReset) and event.stream_id in self.responses:
            resp = self.responses[event.stream_id]
            resp.reset_code = event.error_code
            resp.changed.set()
        elif isinstance(event, ConnectionTerminated):
            self.close_event = event
            self.terminated.set()
            for resp in self.responses.values():
                resp.changed.set()

    def request(
        self,
        path: str,
        *,
        method: bytes = b"POST",
        rid: str = "-",
        body: bytes = b"",
        end: bool = True,
        headers: list[Any] | None = None,
    ) -> H3Response:
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, [
            (b":method", method), (b":scheme", b"https"), (b":authority", b"localhost"),
            (b":path", path.encode()), (b"x-test-id", rid.encode()), *(headers or []),
        ], end_stream=end and not body)
        if body:
            self.h3.send_data(sid, body, end_stream=end)
        resp = self.responses[sid] = H3Response(self, sid)
        self.transmit()
        return resp

    def stop_sending(self, sid: int) -> None:
        self._quic.stop_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()

    def reset(self, sid: int) -> None:
        self._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()


@contextlib.asynccontextmanager
async def h3_client(port: int, cert: Path) -> AsyncIterator[H3Client]:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    configuration.load_verify_locations(cafile=str(cert))
    async with connect(
        "127.0.0.1", port, configuration=configuration, create_protocol=H3Client, wait_connected=True
    ) as client:
        assert isinstance(client, H3Client)
        yield client


def udp_port(running: Running) -> int:
    return int(running.udp.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
async def h3srv(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    async with serving(tmp_path_factory.mktemp("h3"), h3=True) as running:
        yield running


# -- the in-process server ---------------------------------------------------------------------


async def test_h3_streams_sse_on_the_tls_port_number(h3srv: Running) -> None:
    assert udp_port(h3srv) == h3srv.tls_port  # UDP takes the TLS listener's number by default
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        resp = client.request("/sse?n=5", rid="h3-1", body=b"hello")
        await resp.until(lambda: resp.ended)
    assert resp.status == 200 and resp.headers[b"x-http-version"] == b"3"
    assert b"connection" not in resp.headers
    events = [e for e in bytes(resp.body).split(b"\n\n") if e]
    assert len(events) == 6 and events[-1] == b"data: [DONE]"
    assert json.loads(events[0].removeprefix(b"data: ")) == {"i": 0, "echo": 5}
    scope = h3srv.app.requests["h3-1"].scope
    assert scope["http_version"] == "3" and scope["scheme"] == "https" and scope["path"] == "/sse"
    assert scope["headers"][0] == (b"host", b"localhost") and scope["client"][0] == "127.0.0.1"


@pytest.mark.parametrize("how", ["stop_sending", "reset_stream", "both"])
async def test_a_cancelled_stream_is_a_disconnect_at_once(h3srv: Running, how: str) -> None:
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        keep = client.request("/slow?n=20", rid=f"h3-keep-{how}")
        # RESET_STREAM means something only while the request is still open (no FIN sent yet)
        resp = client.request("/nobody/forever", rid=f"h3-{how}", end=how == "stop_sending")
        await resp.until(lambda: resp.body.count(b"data: ") >= 3)
        if how in ("stop_sending", "both"):
            client.stop_sending(resp.stream_id)
        if how in ("reset_stream", "both"):
            client.reset(resp.stream_id)
        rec = h3srv.app.requests[f"h3-{how}"]
        await asyncio.wait_for(rec.hook_fired.wait(), 2)
        await asyncio.wait_for(rec.disconnect.wait(), 2)
        await asyncio.wait_for(rec.finished.wait(), 2)
        assert rec.errors == []  # writes after the reset were no-ops, not aioquic errors
        # the connection and its other streams are unharmed
        await keep.until(lambda: keep.ended)
        assert keep.body.endswith(DONE)
        again = client.request("/sse?n=1")
        await again.until(lambda: again.ended)
        assert again.status == 200


async def test_connection_close_is_a_disconnect_for_every_stream(h3srv: Running) -> None:
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        streams = [client.request("/forever", rid=f"h3-close-{i}") for i in range(3)]
        for resp in streams:
            await resp.until(lambda r=resp: len(r.body) > 10)
        client.close()
        for i in range(3):
            rec = h3srv.app.requests[f"h3-close-{i}"]
            await asyncio.wait_for(rec.hook_fired.wait(), 2)
            await asyncio.wait_for(rec.disconnect.wait(), 2)
            await asyncio.wait_for(rec.finished.wait(), 2)


async def test_a_client_gone_silent_is_a_disconnect_after_the_idle_timeout(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, h3=True, idle_timeout_s=0.5) as running,
        h3_client(udp_port(running), running.cert) as client,
    ):
        resp = client.request("/forever", rid="h3-silent")
        await resp.until(lambda: len(resp.body) > 10)
        client.mute = True  # no ACKs, no CONNECTION_CLOSE: the client is simply gone
        client.deaf = True
        rec = running.app.requests["h3-silent"]
        await asyncio.wait_for(rec.hook_fired.wait(), 5)
        await asyncio.wait_for(rec.disconnect.wait(), 2)
        await asyncio.wait_for(rec.finished.wait(), 2)
        client.mute = client.deaf = False


async def test_a_terminated_connection_leaves_nothing_for_the_garbage_collector(tmp_path: Path) -> None:
    """Once a QUIC connection has ended, reference counting frees the server's side of it (aioquic's
    connection with its streams, loss recovery and crypto contexts; the protocol): none of the
    callbacks aioquic keeps to the connection itself, nor the server's handlers on the protocol,
    hold it in a cycle. (The client's connections, in this process too, are not the server's.)"""
    async with serving(tmp_path, h3=True) as srv:
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                async with h3_client(udp_port(srv), srv.cert) as client:
                    resp = client.request("/sse?n=2", body=b"x")
                    await resp.until(lambda r=resp: r.ended)
            left = await server_garbage(
                srv,
                h3_server.H3Protocol,
                lambda o: isinstance(o, h3_server.H3Protocol)
                or (isinstance(o, QuicConnection) and not o._is_client),
            )
        finally:
            gc.enable()
    assert left == []


async def test_a_stalled_client_blocks_send_with_bounded_buffers(h3srv: Running) -> None:
    chunks, size = 512, 4096  # 2 MiB
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        resp = client.request(f"/bulk?chunks={chunks}&size={size}", rid="h3-stall")
        await resp.until(lambda: len(resp.body) > 0)
        client.deaf = True  # nothing it receives is processed, so nothing is acknowledged
        rec = h3srv.app.requests["h3-stall"]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rec.all_sent.wait(), 1.0)
        connections = h3srv.server.server_state.connections
        protocol = next(c for c in connections if isinstance(c, h3_server.H3Protocol))
        unsent = h3_server._unsent(protocol._quic, resp.stream_id)
        # send() waits: what aioquic holds unsent stays between the marks (plus one chunk)
        assert h3_server.LOW_WATER < unsent <= h3_server.HIGH_WATER + size + 16
        assert rec.sent < chunks * size // 2
        client.deaf = False  # the server's probes get answered, and the rest flows
        await resp.until(lambda: resp.ended, timeout_s=30)
    assert len(resp.body) == chunks * size + len(DONE) and rec.all_sent.is_set()


async def test_many_concurrent_streams_on_one_connection(h3srv: Running) -> None:
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        responses = [client.request("/sse?n=20", rid=f"h3-many-{i}") for i in range(60)]
        for resp in responses:
            await resp.until(lambda r=resp: r.ended)
    assert all(r.status == 200 and r.body.endswith(DONE) and r.body.count(b"data: ") == 21 for r in responses)
    assert len({h3srv.app.requests[f"h3-many-{i}"].scope["client"] for i in range(60)}) == 1


async def test_a_burst_starts_one_stream_at_once_and_the_rest_on_later_turns(
    h3srv: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on HTTP/2 (``transports/stream_starts.py``): the streams of one flight start one per
    connection in the loop turn that read them, the rest on the turns after, and all are answered."""
    at_once: list[bool] = []

    class Watched(StreamStarts):
        def start(self, connection: Any, begin: Any, stream: Any) -> None:
            began: list[bool] = []
            super().start(connection, lambda s: began.append(True) or begin(s), stream)
            at_once.append(bool(began))

    watched = Watched(asyncio.get_running_loop())
    monkeypatch.setattr(h3_server, "stream_starts", lambda loop: watched)
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        client.mute = True  # the whole burst in one flight
        burst = [client.request("/sse?n=2", rid=f"h3-turns-{i}") for i in range(9)]
        client.mute = False
        client.transmit()
        for resp in burst:
            await resp.until(lambda r=resp: r.ended)
    assert at_once == [True] + [False] * 8
    assert all(r.status == 200 and r.body.endswith(DONE) for r in burst)


async def test_streams_cancelled_within_their_burst_never_reach_the_app(h3srv: Running) -> None:
    """A client's STOP_SENDING sent with its request's HEADERS arrives first (aioquic writes a
    stream's control frames before its data): the request is dropped as it is read, and the app
    (the pod, behind the gateway) never hears of it."""
    async with h3_client(udp_port(h3srv), h3srv.cert) as client:
        client.mute = True  # queue the whole burst and its cancellations, then send them in one flight
        first = client.request("/sse?n=2", rid="h3-burst-0")
        cancelled = [client.request("/sse?n=2", rid=f"h3-burst-cancelled-{i}") for i in range(8)]
        for resp in cancelled:
            client.stop_sending(resp.stream_id)
        client.mute = False
        client.transmit()
        await first.until(lambda: first.ended)
        after = client.request("/sse?n=2", rid="h3-burst-after")  # the connection serves on
        await after.until(lambda: after.ended)
    assert first.body.endswith(DONE) and after.body.endswith(DONE)
    assert not [rid for rid in h3srv.app.requests if rid.startswith("h3-burst-cancelled-")]


async def test_garbage_datagrams_are_ignored(h3srv: Running) -> None:
    port = udp_port(h3srv)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"\x00garbage", ("127.0.0.1", port))
        sock.sendto(os.urandom(1200), ("127.0.0.1", port))
        # a long header claiming QUIC v1 Initial, with nonsense inside
        initial = b"\xc0\x00\x00\x00\x01\x08" + os.urandom(8) + b"\x08" + os.urandom(1300)
        sock.sendto(initial, ("127.0.0.1", port))
    async with h3_client(port, h3srv.cert) as client:
        resp = client.request("/sse?n=1")
        await resp.until(lambda: resp.ended)
    assert resp.status == 200


async def test_shutdown_goaway_rejects_new_streams_and_lets_open_ones_finish(tmp_path: Path) -> None:
    async with serving(tmp_path, h3=True) as running, h3_client(udp_port(running), running.cert) as client:
        slow = client.request("/slow?n=100", rid="h3-slow")
        await slow.until(lambda: len(slow.body) > 0)
        for connection in list(running.server.server_state.connections):
            connection.shutdown()  # what uvicorn's shutdown does first
        late = client.request("/sse?n=1", rid="h3-late")
        await late.until(lambda: late.reset_code is not None)
        assert late.reset_code == ErrorCode.H3_REQUEST_REJECTED and "h3-late" not in running.app.requests
        await slow.until(lambda: slow.ended)
        assert slow.body.endswith(DONE)
        await asyncio.wait_for(client.terminated.wait(), 5)  # closed by the server once idle
        assert client.close_event is not None and client.close_event.error_code == ErrorCode.H3_NO_ERROR


# -- the gateway process in front of the pod simulator -----------------------------------------


@pytest.fixture(scope="module")
def gateway(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, int, Path]]:
    with tls_gateway(fleet, tmp_path_factory.mktemp("gw-h3")) as running:
        yield running


async def test_gateway_streams_over_h3(gateway: tuple[GatewayProcess, int, Path]) -> None:
    gw, port, cert = gateway
    body = json.dumps(CHAT).encode()
    async with h3_client(port, cert) as client:
        resp = client.request(
            "/v1/chat/completions", body=body, headers=[(b"content-type", b"application/json")]
        )
        await resp.until(lambda: resp.ended)
        models = client.request("/v1/models", method=b"GET")
        await models.until(lambda: models.ended)
    assert resp.status == 200 and resp.headers[b"content-type"].startswith(b"text/event-stream")
    async with httpx.AsyncClient() as http:
        over_h1 = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert _sse_text(bytes(resp.body)) == _sse_text(over_h1.content) != ""
    # answers over TCP advertise HTTP/3 on the UDP port; those over HTTP/3 need not
    assert over_h1.headers.get("alt-svc", "").startswith(f'h3=":{port}"')
    assert b"alt-svc" not in resp.headers
    assert models.status == 200 and json.loads(models.body)["data"]  # the Starlette control plane


@pytest.mark.parametrize("how", ["stop_sending", "close"])
async def test_gateway_aborts_the_pod_when_an_h3_client_leaves(
    fleet: Fleet, gateway: tuple[GatewayProcess, int, Path], how: str
) -> None:
    _, port, cert = gateway
    rid = f"h3-leave-{how}"
    async with h3_client(port, cert) as client:
        resp = client.request(
            "/v1/chat/completions", body=json.dumps(LONG).encode(),
            headers=[(b"content-type", b"application/json"), (b"x-request-id", rid.encode())],
        )
        await resp.until(lambda: resp.body.count(b"data: ") >= 3)  # tokens are flowing
        assert resp.status == 200
        if how == "stop_sending":
            client.stop_sending(resp.stream_id)
        else:
            client.close()
        assert await asyncio.to_thread(wait_for, lambda: aborted(fleet, rid))


async def test_sigterm_drain_lets_h2_and_h3_streams_finish_then_exits_0(fleet: Fleet, tmp_path: Path) -> None:
    body = json.dumps({**LONG, "max_tokens": 200}).encode()
    with tls_gateway(fleet, tmp_path) as (gw, port, cert):
        h2_client = await RawH2.open(port, tls=client_context(cert, ["h2"]))
        sid = h2_client.chat(body)
        async with h3_client(port, cert) as client:
            resp = client.request(
                "/v1/chat/completions", body=body, headers=[(b"content-type", b"application/json")]
            )
            await resp.until(lambda: resp.body.count(b"data: ") >= 2)
            await h2_client.pump_until(lambda: h2_client.body[sid].count(b"data: ") >= 2)
            stopping = asyncio.ensure_future(asyncio.to_thread(gw.stop, 20))  # SIGTERM: drain, then exit
            await resp.until(lambda: resp.ended, timeout_s=20)
            await h2_client.pump_until(lambda: sid in h2_client.ended, timeout_s=20)
            assert await stopping == 0
        assert resp.status == 200 and _sse_text(bytes(resp.body))
        assert h2_client.status[sid] == 200 and _sse_text(bytes(h2_client.body[sid]))
        h2_client.close()
