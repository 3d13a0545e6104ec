"""HTTP/2 listeners (h2c on the cleartext port, h2 by ALPN on the TLS port), over real sockets.

Two servers: an in-process one serving a small SSE app that records what it sees (to check the
ASGI contract: disconnects, back-pressure, many streams), and a real gateway process in front of
the pod simulator (to check that a client leaving aborts the pod's generation). Clients: httpx
(h2 over TLS and with prior knowledge), curl, and a raw h2 client for what httpx cannot do
(reset one stream, stop reading, send garbage).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import httpx
import pytest
import uvicorn
import yaml
from hpack import NeverIndexedHeaderTuple

from gateway.config import ConfigError
from gateway.config_load import parse_config, with_overrides
from gateway.server import ExtraListeners, Server, alt_svc, build_server, extra_listeners
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from tests.conftest import Fleet, tls_config, wait_for
from transports.asgi_stream import AsgiStream
from transports.h1_disconnect import PromptH1Protocol, trip_on_disconnect
from transports.h2_dispatch import CleartextDispatch
from transports.h2_server import PREFACE, H2Protocol, H2Settings
from transports.same_delay_timers import SameDelayTimers
from transports.tls import self_signed, server_context

# -- the in-process server and its app ---------------------------------------------------------

DONE = b"data: [DONE]\n\n"


class Recorder:
    """What the app saw for one request (keyed by the client's x-test-id header)."""

    def __init__(self) -> None:
        self.hook_fired = asyncio.Event()  # the on-disconnect callback (as the relay registers it)
        self.disconnect = asyncio.Event()  # receive() returned http.disconnect
        self.finished = asyncio.Event()  # the app's sending loop ended
        self.all_sent = asyncio.Event()
        self.sent = 0  # body bytes whose send() has returned
        self.body = b""
        self.scope: dict[str, Any] = {}
        self.errors: list[BaseException] = []


class SseApp:
    """``/sse?n=N`` streams N events then ``[DONE]`` (``/slow?n=N``: one each 5 ms); ``/forever``
    streams until the client leaves; ``/bulk?chunks=N&size=S`` sends N chunks of S bytes. The
    request body is read first, except on ``/nobody``-prefixed paths."""

    def __init__(self) -> None:
        self.requests: dict[str, Recorder] = {}

    def recorder(self, rid: str) -> Recorder:
        if rid not in self.requests:
            self.requests[rid] = Recorder()
        return self.requests[rid]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        headers = dict(scope["headers"])
        rec = self.recorder(headers.get(b"x-test-id", b"-").decode())
        rec.scope = scope
        path = scope["path"]
        query = dict(p.split("=") for p in scope["query_string"].decode().split("&") if p)
        if not path.startswith("/nobody"):
            while True:
                message = await receive()
                rec.body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        path = path.removeprefix("/nobody")
        hook = trip_on_disconnect(receive, rec.hook_fired.set)
        assert hook is not None, "the stream offers no disconnect hook"

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            rec.disconnect.set()

        watcher = asyncio.ensure_future(watch()) if path != "/bulk" else None
        if path == "/badheader":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"a\nb")]})
            await send({"type": "http.response.body", "body": b"never seen"})
            rec.finished.set()
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"Connection", b"keep-alive"),
                (b"x-http-version", scope["http_version"].encode()),
                (b"x-request-id", headers.get(b"x-test-id", b"-")), (b"x-padded", b" value\t")]})
            if path == "/bulk":
                chunk = b"x" * int(query.get("size", "4096"))
                for _ in range(int(query.get("chunks", "100"))):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    rec.sent += len(chunk)
                rec.all_sent.set()
            elif path == "/slow":
                for i in range(int(query.get("n", "100"))):
                    await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
                    await asyncio.sleep(0.005)
            elif path == "/forever":
                i = 0
                while not rec.hook_fired.is_set():
                    await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
                    i += 1
                    await asyncio.sleep(0.005)
                # after the client left, sends are no-ops: they neither raise nor block
                await send({"type": "http.response.body", "body": b"data: late\n\n", "more_body": True})
            else:
                for i in range(int(query.get("n", "5"))):
                    event = b"data: " + json.dumps({"i": i, "echo": len(rec.body)}).encode() + b"\n\n"
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            # and after the response is complete as well
            await send({"type": "http.response.body", "body": b"ignored", "more_body": False})
        except BaseException as exc:
            rec.errors.append(exc)
            raise
        finally:
            hook.disarm()
            rec.finished.set()
            if watcher is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(watcher), 5)


class Running:
    def __init__(self, server: Server, app: SseApp, cert: Path) -> None:
        self.server = server
        self.app = app
        self.cert = cert
        self.http = server.urls[0]
        self.https = server.urls[1] if len(server.urls) > 1 else ""
        self.udp = server.urls[2] if len(server.urls) > 2 else ""

    @property
    def port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])

    @property
    def tls_port(self) -> int:
        return int(self.https.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def serving(
    tmp: Path,
    *,
    h3: bool = False,
    h2_settings: H2Settings | None = None,
    idle_timeout_s: float = 30.0,
    keep_alive_s: float = 30.0,
) -> AsyncIterator[Running]:
    """``SseApp`` behind the gateway's ``Server`` with all its listeners, on kernel-chosen ports."""
    cert, key = self_signed(tmp)
    app = SseApp()
    settings = h2_settings or H2Settings()
    uv = uvicorn.Config(
        app, host="127.0.0.1", port=0, http=functools.partial(
            CleartextDispatch, h2_settings=settings, first_bytes=SameDelayTimers(10.0)
        ),
        lifespan="off", log_config=None, access_log=False, timeout_keep_alive=keep_alive_s,
    )
    quic = None
    if h3:
        from transports.h3_server import quic_configuration

        quic = quic_configuration(cert, key, idle_timeout_s=idle_timeout_s)
    server = Server(uv, ExtraListeners(tls=server_context(cert, key), tls_port=0, quic=quic, h2=settings))
    task = asyncio.create_task(server.serve())
    listening = asyncio.ensure_future(server.listening.wait())
    await asyncio.wait([task, listening], return_when=asyncio.FIRST_COMPLETED)
    assert server.listening.is_set(), "the server did not start"
    try:
        yield Running(server, app, cert)
    finally:
        server.should_exit = True
        await task


@pytest.fixture(scope="module")
async def srv(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    async with serving(tmp_path_factory.mktemp("h2tls")) as running:
        yield running


def client_context(cert: Path, alpn: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert))
    context.set_alpn_protocols(alpn)
    return context


# -- a raw HTTP/2 client (resets, flow control, garbage) ----------------------------------------


class RawH2:
    """Client side of h2 over an asyncio stream; reads only when told to (``pump_until``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int) -> None:
        self.reader = reader
        self.writer = writer
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            },
        )
        self.conn.initiate_connection()
        if window > 65_535:
            self.conn.increment_flow_control_window(window - 65_535)
        self.auto_ack = True
        self.unacked: dict[int, int] = {}
        self.status: dict[int, int] = {}
        self.body: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.reset_by_server: dict[int, int] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.eof = False
        self.flush()

    @classmethod
    async def open(
        cls, port: int, *, tls: ssl.SSLContext | None = None, window: int = 65_535
    ) -> RawH2:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls, server_hostname="localhost" if tls else None
        )
        return cls(reader, writer, window)

    def flush(self) -> None:
        data = self.conn.data_to_send()  # the first carries the client preface (h2c prior knowledge)
        if data:
            self.writer.write(data)

    def request(self, path: str, *, rid: str = "-", body: bytes = b"", end: bool = True) -> int:
        sid = self.conn.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"localhost"),
            (b":path", path.encode()), (b"x-test-id", rid.encode()),
        ]
        self.conn.send_headers(sid, headers, end_stream=end and not body)
        if body:
            self.conn.send_data(sid, body, end_stream=end)
        self.body[sid] = bytearray()
        self.flush()
        return sid

    def chat(self, body: bytes, *, rid: str | None = None) -> int:
        """POST ``body`` to the gateway's ``/v1/chat/completions`` over TLS; the stream id."""
        sid = self.conn.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"localhost"),
            (b":path", b"/v1/chat/completions"), (b"content-type", b"application/json"),
        ]
        if rid is not None:
            headers.append((b"x-request-id", rid.encode()))
        self.conn.send_headers(sid, headers)
        self.conn.send_data(sid, body, end_stream=True)
        self.body[sid] = bytearray()
        self.flush()
        return sid

    def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        self.flush()

    def ack(self) -> None:
        for sid, size in self.unacked.items():
            self.conn.acknowledge_received_data(size, sid)
        self.unacked.clear()
        self.flush()

    async def pump_until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                data = await self.reader.read(65536)
                if not data:
                    self.eof = True
                    if not done():
                        raise ConnectionError("server closed the connection")
                    return
                for event in self.conn.receive_data(data):
                    self._on(event)
                self.flush()

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.status[event.stream_id] = int(dict(event.headers)[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            self.body[event.stream_id] += event.data
            if self.auto_ack:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                sid = event.stream_id
                self.unacked[sid] = self.unacked.get(sid, 0) + event.flow_controlled_length
        elif isinstance(event, h2.events.StreamEnded):
            self.ended.add(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self.reset_by_server[event.stream_id] = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event

    def close(self) -> None:
        self.writer.close()


# -- the in-process server: protocol and ASGI contract -----------------------------------------


async def test_h2c_prior_knowledge_streams_sse(srv: Running) -> None:
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        resp = await client.post(srv.http + "/sse?n=5", content=b"hello", headers={"x-test-id": "h2c-1"})
    assert resp.http_version == "HTTP/2" and resp.status_code == 200
    assert resp.headers["x-http-version"] == "2" and "connection" not in resp.headers
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert len(events) == 6 and events[-1] == b"data: [DONE]"
    assert json.loads(events[0].removeprefix(b"data: ")) == {"i": 0, "echo": 5}
    scope = srv.app.requests["h2c-1"].scope
    assert scope["scheme"] == "http" and scope["method"] == "POST" and scope["path"] == "/sse"
    assert scope["query_string"] == b"n=5" and scope["headers"][0] == (b"host", b"127.0.0.1:%d" % srv.port)
    assert scope["client"][0] == "127.0.0.1" and scope["server"] == ("127.0.0.1", srv.port)


async def server_garbage(srv: Running, protocol: type, ours: Callable[[object], bool]) -> list[str]:
    """Once the server has no ``protocol`` connection left, what of its own (``ours``) the collector
    finds in cycles. For a test that turned the collector off before its connections opened."""
    connections = srv.server.server_state.connections
    gone = await asyncio.to_thread(
        wait_for, lambda: not any(isinstance(c, protocol) for c in list(connections))
    )
    assert gone, f"the server's {protocol.__name__} connections did not end"
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [type(o).__name__ for o in gc.garbage if ours(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_a_closed_connection_leaves_nothing_for_the_garbage_collector(tmp_path: Path) -> None:
    """Once an HTTP/2 connection closes, reference counting frees its state (h2's HPACK tables,
    stream map and buffers; the protocol's own): neither h2's frame handlers nor the protocol's
    event handlers keep it in a cycle, which a connection that lived a while would leave until a
    full collection. (The client's own h2 connection, in this process too, is not the server's.)"""
    async with serving(tmp_path) as srv:
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                async with httpx.AsyncClient(http1=False, http2=True) as client:
                    resp = await client.post(srv.http + "/sse?n=2", content=b"x")
                    assert resp.http_version == "HTTP/2" and resp.status_code == 200
            left = await server_garbage(
                srv,
                H2Protocol,
                lambda o: isinstance(o, H2Protocol)
                or (isinstance(o, h2.connection.H2Connection) and not o.config.client_side),
            )
        finally:
            gc.enable()
    assert left == []


async def test_tls_alpn_picks_h2_or_http11(srv: Running) -> None:
    async with httpx.AsyncClient(http2=True, verify=client_context(srv.cert, ["h2", "http/1.1"])) as client:
        resp = await client.post(srv.https + "/sse?n=3", headers={"x-test-id": "tls-h2"})
    assert resp.http_version == "HTTP/2" and resp.headers["x-http-version"] == "2"
    assert resp.text.endswith("data: [DONE]\n\n") and resp.text.count("data: ") == 4
    assert srv.app.requests["tls-h2"].scope["scheme"] == "https"
    async with httpx.AsyncClient(verify=client_context(srv.cert, ["http/1.1"])) as client:
        resp = await client.post(srv.https + "/sse?n=3", headers={"x-test-id": "tls-h1"})
    assert resp.http_version == "HTTP/1.1" and resp.headers["x-http-version"] == "1.1"
    assert resp.text.endswith("data: [DONE]\n\n")
    assert srv.app.requests["tls-h1"].scope["scheme"] == "https"
    # and plain HTTP/1.1 on the cleartext port is uvicorn's, as before
    async with httpx.AsyncClient() as client:
        resp = await client.post(srv.http + "/sse?n=2")
    assert resp.http_version == "HTTP/1.1" and resp.text.endswith("data: [DONE]\n\n")


def _curl_http2() -> bool:
    curl = shutil.which("curl")
    if curl is None:
        return False
    return "HTTP2" in subprocess.run([curl, "-V"], capture_output=True, text=True).stdout


needs_curl = pytest.mark.skipif(not _curl_http2(), reason="curl with HTTP/2 support is not installed")


@needs_curl
async def test_curl_h2c_and_h2_over_tls(srv: Running) -> None:
    for args in (
        ["--http2-prior-knowledge", srv.http + "/sse?n=4"],
        ["--http2", "--cacert", str(srv.cert), srv.https.replace("127.0.0.1", "localhost") + "/sse?n=4"],
    ):
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--max-time", "10", "-d", "{}", "-w", "\n%{http_version}", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        body, version = out.rsplit(b"\n", 1)
        assert version == b"2" and body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 5


async def test_rst_stream_is_a_disconnect_at_once(srv: Running) -> None:
    client = await RawH2.open(srv.port)
    try:
        keep = client.request("/sse?n=3", rid="rst-keep")
        sid = client.request("/forever", rid="rst-1")
        await client.pump_until(lambda: len(client.body[sid]) > 30)
        client.reset(sid)
        rec = srv.app.requests["rst-1"]
        await asyncio.wait_for(rec.hook_fired.wait(), 2)
        await asyncio.wait_for(rec.disconnect.wait(), 2)
        await asyncio.wait_for(rec.finished.wait(), 2)
        assert rec.errors == []  # sends after the reset did nothing, and did not raise
        # the connection and its other streams carry on
        await client.pump_until(lambda: keep in client.ended)
        assert client.body[keep].endswith(b"data: [DONE]\n\n")
        again = client.request("/sse?n=1", rid="rst-after")
        await client.pump_until(lambda: again in client.ended)
        assert client.status[again] == 200
    finally:
        client.close()


@pytest.mark.parametrize("how", ["close", "goaway"])
async def test_connection_gone_is_a_disconnect_for_every_stream(srv: Running, how: str) -> None:
    client = await RawH2.open(srv.tls_port, tls=client_context(srv.cert, ["h2"]))
    sids = [client.request("/forever", rid=f"{how}-{i}") for i in range(3)]
    await client.pump_until(lambda: all(len(client.body[s]) > 10 for s in sids))
    if how == "goaway":
        client.conn.close_connection()
        client.flush()
    else:
        client.writer.transport.abort()  # no GOAWAY, no FIN handshake: just gone
    for i in range(3):
        rec = srv.app.requests[f"{how}-{i}"]
        await asyncio.wait_for(rec.hook_fired.wait(), 2)
        await asyncio.wait_for(rec.disconnect.wait(), 2)
        await asyncio.wait_for(rec.finished.wait(), 2)
        assert rec.errors == []
    client.close()


async def test_closed_window_blocks_send_until_the_client_reads(srv: Running) -> None:
    client = await RawH2.open(srv.port, window=65_535)
    try:
        client.auto_ack = False  # read frames but never open the window again
        sid = client.request("/bulk?chunks=200&size=4096", rid="window")
        await client.pump_until(lambda: len(client.body[sid]) >= 65_535)
        rec = srv.app.requests["window"]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rec.all_sent.wait(), 0.5)
        # one window's worth went out; the app's send() holds the rest of one chunk, no more
        assert len(client.body[sid]) == 65_535
        assert rec.sent < 65_535 + 4096
        client.auto_ack = True
        client.ack()
        await client.pump_until(lambda: sid in client.ended)
        assert len(client.body[sid]) == 200 * 4096 + len(DONE) and rec.all_sent.is_set()
    finally:
        client.close()


async def test_client_not_reading_bounds_the_servers_buffer(srv: Running) -> None:
    """A huge window, but the client stops reading its socket: send() waits on the transport."""
    total = 16 * 1024 * 1024
    client = await RawH2.open(srv.port, window=2**31 - 1)
    try:
        sid = client.request(f"/bulk?chunks={total // 16384}&size=16384", rid="socket")
        await client.pump_until(lambda: len(client.body[sid]) > 0)
        rec = srv.app.requests["socket"]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rec.all_sent.wait(), 1.0)
        # kernel buffers (a few MiB on loopback) plus the transport's high-water mark, not 16 MiB
        assert rec.sent < total // 2
        await client.pump_until(lambda: sid in client.ended, timeout_s=30)
        assert len(client.body[sid]) == total + len(DONE) and rec.all_sent.is_set()
    finally:
        client.close()


async def test_request_body_larger_than_the_window_arrives_whole(srv: Running) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: several stream windows, acknowledged as read
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        resp = await client.post(srv.http + "/sse?n=1", content=body, headers={"x-test-id": "upload"})
    assert resp.status_code == 200 and srv.app.requests["upload"].body == body


async def test_an_invalid_response_header_is_the_apps_error_not_the_connections(srv: Running) -> None:
    client = await RawH2.open(srv.port)
    try:
        bad = client.request("/badheader", rid="bad")
        await client.pump_until(lambda: bad in client.ended)
        assert client.status[bad] == 500  # send() raised, as under uvicorn; nothing invalid went out
        good = client.request("/sse?n=1")
        await client.pump_until(lambda: good in client.ended)
        assert client.status[good] == 200
    finally:
        client.close()


async def test_response_headers_are_normalised_and_none_enter_the_clients_hpack_table(srv: Running) -> None:
    """The client validates what it receives (h2's default): a value with surrounding whitespace
    arrives stripped, a connection header not at all. No field is offered to the client's HPACK
    table (``transports.hpack_stateless``): its decoder keeps nothing for us, and a request id,
    different on every response, is a plain literal, not a never-indexed secret."""
    client = await RawH2.open(srv.port)
    responses: list[list[tuple[bytes, bytes]]] = []
    on = client._on

    def keep(event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            responses.append(event.headers)
        on(event)

    client._on = keep  # type: ignore[method-assign]
    try:
        for i in range(20):
            sid = client.request("/sse?n=1", rid=f"hpack-{i}")
            await client.pump_until(lambda sid=sid: sid in client.ended)
            assert client.status[sid] == 200
    finally:
        client.close()
    for i, headers in enumerate(responses):
        fields = dict(headers)
        assert fields[b"x-padded"] == b"value"
        assert b"connection" not in fields
        assert fields[b"x-request-id"] == f"hpack-{i}".encode()
        (rid,) = (h for h in headers if h[0] == b"x-request-id")
        assert not isinstance(rid, NeverIndexedHeaderTuple)
    assert len(client.conn.decoder.header_table.dynamic_entries) == 0


async def test_many_concurrent_streams_share_one_connection(srv: Running) -> None:
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        responses = await asyncio.gather(
            *(client.post(srv.http + "/sse?n=20", headers={"x-test-id": f"many-{i}"}) for i in range(60))
        )
    assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in responses)
    assert all(r.text.count("data: ") == 21 for r in responses)
    ports = {srv.app.requests[f"many-{i}"].scope["client"][1] for i in range(60)}
    assert len(ports) == 1


async def test_max_concurrent_streams_is_announced_and_respected(tmp_path: Path) -> None:
    async with serving(tmp_path, h2_settings=H2Settings(max_concurrent_streams=4)) as small:
        async with httpx.AsyncClient(http1=False, http2=True) as client:
            responses = await asyncio.gather(*(client.post(small.http + "/sse?n=3") for _ in range(12)))
        assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in responses)


async def test_garbage_closes_the_connection_and_the_server_lives_on(srv: Running) -> None:
    # a valid preface followed by bytes that are no HTTP/2 frame: GOAWAY, then the connection closes
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(PREFACE + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + b"\xff" * 64)
    answer = await asyncio.wait_for(reader.read(), 5)
    frames = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    frames.initiate_connection()
    events = frames.receive_data(answer)
    assert any(isinstance(e, h2.events.ConnectionTerminated) and e.error_code != 0 for e in events)
    writer.close()
    # something that is neither the preface nor HTTP/1.1: uvicorn answers 400 and closes
    for junk in (b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", b"\x16\x03\x01\x02\x00" + b"\x01" * 300):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(junk)
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 400")
        writer.close()
    # plain bytes on the TLS port: the handshake fails, the connection closes
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.tls_port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert not (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/")
    writer.close()
    # a client that leaves half-way through the preface
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(PREFACE[:10])
    writer.close()
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        resp = await client.post(srv.http + "/sse?n=1")
    assert resp.status_code == 200


async def test_shutdown_refuses_new_streams_lets_open_ones_finish_then_goaway(tmp_path: Path) -> None:
    async with serving(tmp_path) as running:
        client = await RawH2.open(running.port)
        client.auto_ack = False
        slow = client.request("/bulk?chunks=64&size=4096", rid="slow")
        await client.pump_until(lambda: len(client.body[slow]) >= 65_535)  # held by the window
        for connection in list(running.server.server_state.connections):
            connection.shutdown()  # what uvicorn's shutdown does first, before it waits for them
        running.server.should_exit = True
        late = client.request("/sse?n=1", rid="late")
        await client.pump_until(lambda: late in client.reset_by_server)
        assert client.reset_by_server[late] == h2.errors.ErrorCodes.REFUSED_STREAM
        client.auto_ack = True
        client.ack()
        await client.pump_until(lambda: client.goaway is not None)
        assert slow in client.ended and len(client.body[slow]) == 64 * 4096 + len(DONE)
        assert client.goaway.error_code == 0
        client.close()


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(tmp_path: Path) -> None:
    async with serving(tmp_path, keep_alive_s=0.3) as running:
        client = await RawH2.open(running.port)
        sid = client.request("/sse?n=1")
        await client.pump_until(lambda: sid in client.ended)
        await client.pump_until(lambda: client.goaway is not None, timeout_s=5)
        assert client.goaway is not None and client.goaway.error_code == 0
        assert await asyncio.wait_for(client.reader.read(), 5) == b""
        client.close()


class _FakeConnection:
    def __init__(self) -> None:
        self.consumed_bytes = 0

    def consumed(self, stream: Any, size: int) -> None:
        self.consumed_bytes += size


async def test_every_receive_waiter_hears_of_the_disconnect() -> None:
    conn = _FakeConnection()
    stream = AsgiStream(conn, 1, {})  # type: ignore[arg-type]
    stream.feed_body(b"abc", 3)
    stream.feed_end()
    assert await stream.receive() == {"type": "http.request", "body": b"abc", "more_body": False}
    assert conn.consumed_bytes == 3
    fired: list[str] = []
    hook = stream.watch_disconnect(lambda: fired.append("gone"))
    waiters = [asyncio.ensure_future(stream.receive()) for _ in range(3)]
    await asyncio.sleep(0)  # let them all wait
    stream.lost()
    assert fired == ["gone"]  # synchronously, inside lost()
    assert [await w for w in waiters] == [{"type": "http.disconnect"}] * 3
    hook.disarm()
    stream.lost()  # twice is harmless
    assert fired == ["gone"]


# -- the gateway process in front of the pod simulator -----------------------------------------

CHAT = {
    "model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True,
}
LONG = {**CHAT, "max_tokens": 4000, "ignore_eos": True}


@contextlib.contextmanager
def tls_gateway(fleet: Fleet, tmp: Path, **tls: Any) -> Iterator[tuple[GatewayProcess, int, Path]]:
    cert, key = self_signed(tmp)
    port = free_tcp_and_udp_port()
    with GatewayProcess(tls_config(fleet, cert, key, port, **tls)) as gw:
        yield gw, port, cert


@pytest.fixture(scope="module")
def gateway(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, int, Path]]:
    with tls_gateway(fleet, tmp_path_factory.mktemp("gw-h2"), h3=False) as running:
        yield running


def aborted(fleet: Fleet, rid: str) -> bool:
    return any(a["id"] == rid for a in httpx.get(fleet.pod_a.url + "/podsim/aborts").json()["aborts"])


def _sse_text(raw: bytes) -> str:
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", raw[-200:]
    text = ""
    for event in events[:-1]:
        payload = json.loads(event.removeprefix(b"data: "))
        text += payload["choices"][0]["delta"].get("content") or ""
    return text


async def test_gateway_streams_over_h2_tls_and_h2c(gateway: tuple[GatewayProcess, int, Path]) -> None:
    gw, port, cert = gateway
    texts = []
    async with httpx.AsyncClient(http2=True, verify=client_context(cert, ["h2", "http/1.1"])) as client:
        resp = await client.post(f"https://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        assert resp.http_version == "HTTP/2" and resp.status_code == 200
        assert resp.headers["alt-svc"] == "clear"  # HTTP/3 is off here: clients forget any advertisement
        texts.append(_sse_text(resp.content))
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        resp = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert resp.http_version == "HTTP/2" and resp.status_code == 200
        texts.append(_sse_text(resp.content))
        models = await client.get(gw.url + "/v1/models")  # the Starlette control plane, over h2c
        assert models.status_code == 200 and models.json()["data"]
    async with httpx.AsyncClient() as client:
        resp = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert resp.http_version == "HTTP/1.1"
        texts.append(_sse_text(resp.content))
    async with httpx.AsyncClient(verify=client_context(cert, ["http/1.1"])) as client:
        resp = await client.post(f"https://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        assert resp.http_version == "HTTP/1.1"  # uvicorn's protocol behind TLS: the relay's splice
        texts.append(_sse_text(resp.content))
    assert texts[0] and len(set(texts)) == 1  # podsim's answers are deterministic


@needs_curl
async def test_gateway_with_curl_http2(gateway: tuple[GatewayProcess, int, Path]) -> None:
    gw, port, cert = gateway
    for args in (
        ["--http2-prior-knowledge", gw.url + "/v1/chat/completions"],
        ["--http2", "--cacert", str(cert), f"https://localhost:{port}/v1/chat/completions"],
    ):
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--max-time", "10", "-H", "content-type: application/json", "-d", json.dumps(CHAT),
            "-w", "\n%{http_version}", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        body, version = out.rsplit(b"\n", 1)
        assert version == b"2" and _sse_text(body)


@pytest.mark.parametrize("how", ["rst_stream", "close"])
async def test_gateway_aborts_the_pod_when_an_h2_client_leaves(
    fleet: Fleet, gateway: tuple[GatewayProcess, int, Path], how: str
) -> None:
    _, port, cert = gateway
    rid = f"h2-leave-{how}"
    client = await RawH2.open(port, tls=client_context(cert, ["h2"]))
    sid = client.chat(json.dumps(LONG).encode(), rid=rid)
    await client.pump_until(lambda: client.body[sid].count(b"data: ") >= 3)  # tokens are flowing
    assert client.status[sid] == 200
    if how == "rst_stream":
        client.reset(sid)
    else:
        client.writer.transport.abort()
    assert await asyncio.to_thread(wait_for, lambda: aborted(fleet, rid))
    client.close()


def test_listener_config_keys(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    config = parse_config({
        "server": {
            "h2c": False,
            "max_concurrent_streams": 7,
            "tls": {"cert": str(cert), "key": str(key), "h3": False},
        },
        "pods": [{"name": "a", "url": "http://127.0.0.1:9"}],
        "auth": {"enabled": False},
    })
    config = with_overrides(config, port=9999)  # the TLS block survives the command-line round trip
    extra = extra_listeners(config)
    assert extra.tls is not None and extra.quic is None and extra.tls_port == 8443 and extra.h3_port is None
    assert extra.h2.max_concurrent_streams == 7
    http = build_server(config).config.http  # h2c off: uvicorn's protocol, with the client limits
    assert issubclass(http.func, PromptH1Protocol) and http.keywords["limits"] == extra.h1
    with pytest.raises(ConfigError, match="tls"):
        parse_config({"server": {"tls": {"cert": str(cert)}}})
    # Alt-Svc names the port clients reach (a load balancer may map 443 to the bound one)
    assert alt_svc(ExtraListeners(), 8443) == b'h3=":8443"; ma=86400'
    assert alt_svc(ExtraListeners(alt_svc_port=443, alt_svc_max_age_s=60), 8443) == b'h3=":443"; ma=60'
    assert alt_svc(ExtraListeners(), None) == b"clear"


def test_bad_certificate_or_taken_port_exit_with_a_clear_message(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"port": 0, "tls": {"cert": str(tmp_path / "missing.pem"), "key": str(tmp_path / "k.pem")}},
        "pods": [{"name": "a", "url": "http://127.0.0.1:9"}],
    }))
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "server.tls" in proc.stderr and "missing.pem" in proc.stderr and "Traceback" not in proc.stderr
    # a file that exists but is not a certificate
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    config.write_text(yaml.safe_dump({
        "server": {"port": 0, "tls": {"cert": str(tmp_path / "junk.pem"), "key": str(tmp_path / "junk.pem")}},
        "pods": [{"name": "a", "url": "http://127.0.0.1:9"}],
    }))
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "junk.pem" in proc.stderr and "Traceback" not in proc.stderr
    # a TLS port that is taken: uvicorn's own rule for a taken port, exit status 3
    cert, key = self_signed(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tls = {"cert": str(cert), "key": str(key), "port": taken.getsockname()[1]}
        config.write_text(yaml.safe_dump({
            "server": {"port": 0, "tls": tls},
            "pods": [{"name": "a", "url": "http://127.0.0.1:9"}],
            "auth": {"enabled": False}, "admin": {"port": 0},
        }))
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 3 and "cannot listen" in proc.stderr and "Traceback" not in proc.stderr
    assert "listening on" not in proc.stdout
