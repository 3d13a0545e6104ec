"""The pod client against real local sockets: keep-alive reuse, stale connections, bad HTTP, splice."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import types
from collections.abc import AsyncIterator, Callable

import pytest

from transports.pod_client import (
    PodBrokenError,
    PodClient,
    PodConnectError,
    PodConnection,
    PodConnectTimeout,
    PodStalledError,
    StallWatch,
)

OK_CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"6\r\ndata: \r\n3\r\nab\n\r\n0\r\n\r\n"
)


class RawServer:
    """A loopback server that answers each request with whatever ``respond`` returns."""

    def __init__(self, respond: Callable[[int], bytes | None], close_after: bool = False) -> None:
        self.respond = respond
        self.close_after = close_after
        self.connections = 0
        self.requests = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.hung_up = asyncio.Event()  # the client closed a connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                answer = self.respond(self.requests)
                if answer is None:
                    writer.close()
                    return
                writer.write(answer)
                await writer.drain()
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Callable[[int], bytes | None]], object]]:
    servers: list[asyncio.Server] = []

    async def start(
        respond: Callable[[int], bytes | None], close_after: bool = False
    ) -> tuple[RawServer, int]:
        raw = RawServer(respond, close_after)
        server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        servers.append(server)
        return raw, server.sockets[0].getsockname()[1]

    yield start
    for server in servers:
        server.close()


async def _post(client: PodClient, port: int) -> bytes:
    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
    body = await resp.read_all()
    resp.release()
    return body


async def test_connections_are_kept_alive_and_reused(serve) -> None:
    raw, port = await serve(lambda _n: OK_CHUNKED)
    client = PodClient(1.0, 30.0)
    for _ in range(3):
        assert await _post(client, port) == b"data: ab\n"
    assert raw.connections == 1 and raw.requests == 3
    await client.close()


async def test_a_connection_the_pod_closed_while_idle_is_replaced_transparently(serve) -> None:
    raw, port = await serve(lambda _n: OK_CHUNKED)
    client = PodClient(1.0, 30.0)
    assert await _post(client, port) == b"data: ab\n"
    raw.writers[0].transport.abort()  # the pod drops the idle keep-alive connection
    assert await _post(client, port) == b"data: ab\n"
    assert raw.connections == 2
    await client.close()


async def test_bytes_a_pod_sends_on_an_idle_connection_close_it(serve) -> None:
    # A pod that answers what nobody asked (here a 408 that would keep the connection) is not one to
    # reuse: as nginx does, the connection is closed, and the next request goes on a fresh one.
    raw, port = await serve(lambda _n: OK_CHUNKED)
    client = PodClient(1.0, 30.0)
    assert await _post(client, port) == b"data: ab\n"
    raw.writers[0].write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
    await asyncio.wait_for(raw.hung_up.wait(), 5)
    assert client.open_connections == 0
    assert await _post(client, port) == b"data: ab\n"
    assert raw.connections == 2 and raw.requests == 2
    await client.close()


async def test_an_idle_connection_keeps_nothing_of_its_last_answer(serve) -> None:
    # Each answer has a parser of its own, which refers to it; a pooled connection lets both go.
    raw, port = await serve(lambda _n: OK_CHUNKED)
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    assert await resp.read_all() == b"data: ab\n"
    resp.release()
    assert _held_by_others(resp) == []
    assert client.open_connections == 1
    assert await _post(client, port) == b"data: ab\n" and raw.connections == 1
    await client.close()


async def test_a_stray_answer_in_the_same_read_closes_the_connection(serve) -> None:
    # The answer's end and the start of another nobody asked for, in one write: none of the stray
    # message (its headers, its length) may reach the next request's answer.
    stray = b"HTTP/1.1 408 Request Timeout\r\nx-stray: 1\r\ncontent-length: 5\r\n"
    raw, port = await serve(lambda n: OK_CHUNKED + stray if n == 1 else OK_CHUNKED)
    client = PodClient(1.0, 30.0)
    assert await _post(client, port) == b"data: ab\n"
    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    assert "x-stray" not in resp.headers and "content-length" not in resp.headers
    assert await resp.read_all() == b"data: ab\n"
    resp.release()
    assert raw.connections == 2
    await client.close()


async def test_a_closed_connection_keeps_nothing_of_its_answer(serve, monkeypatch) -> None:
    # A client that leaves closes the pod's connection; the answer must go when the request does,
    # not wait for a garbage collection (the parser refers to it, and it to the connection).
    lost = asyncio.Event()
    closing = PodConnection.connection_lost

    def connection_lost(conn: PodConnection, exc: Exception | None) -> None:
        closing(conn, exc)
        lost.set()

    monkeypatch.setattr(PodConnection, "connection_lost", connection_lost)
    _, port = await serve(lambda _n: OK_CHUNKED[: OK_CHUNKED.index(b"3\r\n")])  # a stream that goes on
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    resp.close()
    await asyncio.wait_for(lost.wait(), 5)
    assert _held_by_others(resp) == []
    await client.close()


def _held_by_others(resp: object) -> list[object]:
    """What refers to ``resp`` besides the test holding it (its coroutine or frame: ``gc.get_referrers``)."""
    return [r for r in gc.get_referrers(resp) if not isinstance(r, (types.FrameType, types.CoroutineType))]


async def test_idle_connections_beyond_the_cap_are_closed(serve) -> None:
    raw, port = await serve(lambda _n: OK_CHUNKED)
    client = PodClient(1.0, 30.0, max_idle_per_pod=0)
    await _post(client, port)
    await _post(client, port)
    assert raw.connections == 2 and client.open_connections == 0
    await client.close()


async def test_refused_connect_and_invalid_http_are_told_apart(serve) -> None:
    client = PodClient(1.0, 30.0)
    _, port = await serve(lambda _n: b"SSH-2.0-OpenSSH_9.2\r\n")
    with pytest.raises(PodBrokenError, match="invalid HTTP"):
        await client.request("127.0.0.1", port, "/", [], b"")
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    free = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(PodConnectError):
        await client.request("127.0.0.1", free, "/", [], b"")
    await client.close()


async def test_a_body_cut_short_raises_for_reads_and_for_splice(serve) -> None:
    cut = OK_CHUNKED[: OK_CHUNKED.index(b"3\r\n")]
    _, port = await serve(lambda _n: cut, close_after=True)
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/", [], b"")
    got: list[bytes] = []
    resp.splice(got.append)
    with pytest.raises(PodBrokenError):
        await asyncio.wait_for(resp.done, 5)
    assert b"".join(got) == b"data: "  # what arrived before the cut, and nothing else
    assert not resp.complete
    await client.close()


async def test_connect_timeout_when_the_pod_never_accepts() -> None:
    # A listener that never accepts, with its tiny backlog already full: new SYNs go unanswered.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    client = PodClient(connect_timeout_s=5.0, keepalive_timeout_s=30.0)
    try:
        with pytest.raises(PodConnectTimeout, match=r"timed out after 0\.2 s"):
            await client.request("127.0.0.1", port, "/", [], b"", connect_timeout_s=0.2)
    finally:
        for sock in (*fillers, listener):
            sock.close()
        await client.close()



def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _lost(conn: PodConnection) -> asyncio.Event:
    """Set once the connection's transport has called ``connection_lost``."""
    lost = asyncio.Event()
    original = conn.connection_lost

    def connection_lost(exc: Exception | None) -> None:
        original(exc)
        lost.set()

    conn.connection_lost = connection_lost  # type: ignore[method-assign]
    return lost


async def test_the_hang_up_watchs_copy_lives_and_dies_with_its_connection(serve) -> None:
    """A pooled connection keeps the copy of its socket that a request's hang-up watch gave back,
    lends it to the next request on it, and closes it when it closes, whether the pod or the
    gateway closes it: no descriptor outlives its connection."""
    raw, port = await serve(lambda _n: OK_CHUNKED)
    client = PodClient(1.0, 30.0)
    before = _open_fds()
    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    assert resp.lend_watch_fd() == -1  # a new connection has none: the watch makes it
    fd = os.dup(resp.socket.fileno())  # type: ignore[union-attr]
    await resp.read_all()
    resp.keep_watch_fd(fd)  # the request's watch gives it back at its end
    resp.release()
    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    assert resp.lend_watch_fd() == fd  # lent to the next request on the same connection
    resp.keep_watch_fd(fd)
    await resp.read_all()
    resp.release()
    # the connection, its kept copy, and the server's end (in this process too)
    assert raw.connections == 1 and _open_fds() == before + 3
    lost = _lost(resp._conn)
    raw.writers[0].transport.abort()  # the pod drops the idle connection
    await asyncio.wait_for(lost.wait(), 5)
    assert _open_fds() == before

    resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
    fd = os.dup(resp.socket.fileno())  # type: ignore[union-attr]  # held by a request's watch
    lost = _lost(resp._conn)
    resp.close()  # the gateway gives up on the answer while the watch holds the copy
    await asyncio.wait_for(lost.wait(), 5)
    resp.keep_watch_fd(fd)  # given back once the connection is gone: closed, not kept
    await asyncio.wait_for(raw.hung_up.wait(), 5)  # and the server's end has gone too
    assert _open_fds() == before
    await client.close()


async def test_an_idle_pooled_connection_closes_at_its_keep_alive_timeout(serve) -> None:
    """A connection back in the pool is closed ``keepalive_timeout_s`` after it went idle; taken out
    for a request first, it stays open however long that request takes, and its wait starts over
    when it comes back (the pool's timeouts share one loop timer)."""
    loop = asyncio.get_running_loop()
    unfinished = OK_CHUNKED.removesuffix(b"0\r\n\r\n")
    raw, port = await serve(lambda n: OK_CHUNKED if n == 1 else unfinished)
    client = PodClient(1.0, 0.3)
    try:
        await _post(client, port)
        resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")  # reused
        await asyncio.sleep(0.4)  # past the first idle spell's timeout, the answer still open
        raw.writers[0].write(b"0\r\n\r\n")
        assert (await resp.read_all()).endswith(b"ab\n")
        resp.release()
        idle_from = loop.time()
        assert raw.connections == 1 and client.open_connections == 1 and not raw.hung_up.is_set()
        await asyncio.wait_for(raw.hung_up.wait(), 5)
        assert loop.time() - idle_from >= 0.3 - 0.01  # its second idle spell's timeout
        assert raw.connections == 1
    finally:
        await client.close()


async def test_a_stall_watch_started_a_little_late_waits_in_the_pools_shared_timeouts(serve) -> None:
    """A burst of streams starts its watches a little after their pods' first bytes (the loop
    admits them in turn). Up to ``FIRST_LOOK_LATE`` of ``stall_s`` late, a watch waits in the pool's
    shared timeouts like one started at once, holding no loop timer of its own."""
    head_only = OK_CHUNKED.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    _raw, port = await serve(lambda _n: head_only)
    client = PodClient(1.0, 30.0)
    try:
        resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
        await asyncio.sleep(0.3)  # the loop busy with the rest of the burst: well under 5 % of 30 s
        shared = client.stall_timeouts(30.0)
        watch = StallWatch(resp, 30.0)
        assert shared.pending == 1 and watch._handle is None
        watch.cancel()
        assert shared.pending == 0
    finally:
        await client.close()


async def test_a_stall_watch_started_late_looks_at_the_pods_last_bytes(serve) -> None:
    """A stall watch started well after the pod's last bytes (the answer's head held back by a slow
    client, say) ends the answer ``stall_s`` after those bytes, not ``stall_s`` after it started."""
    loop = asyncio.get_running_loop()
    head_only = OK_CHUNKED.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    _raw, port = await serve(lambda _n: head_only)  # the head, then silence
    client = PodClient(1.0, 30.0)
    try:
        resp = await client.request("127.0.0.1", port, "/v1/chat/completions", [], b"{}")
        await asyncio.sleep(1.0)  # the pod's silence before the watch starts
        started = loop.time()
        watch = StallWatch(resp, 1.2)  # due 0.2 s from now; a first look from now would be 1.2 s
        with pytest.raises(PodStalledError):
            await asyncio.wait_for(resp.done, 5)
        assert loop.time() - started < 0.9
        watch.cancel()
    finally:
        await client.close()
