"""HTTP/3 hardening, over real UDP sockets: early answers that reach a Chromium-like uploader, the
per-connection stream cap, the connection table, Retry, the handshake deadline, and the send-stall
deadline. The clients are the attack clients in loadtest/attacks/h3.py (aioquic).

Two servers: the gateway's own ``Server`` in this process with a small app (to reach the listener's
counters and to hold requests open), and a real gateway process before the pod simulator (for the
413, the gRPC-Web error and the pod abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gateway.server import ExtraListeners, Server
from loadtest.attacks import h3 as attacks
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from tests.conftest import Fleet, pod_aborts, tls_config, wait_for
from transports.h3_guard import H3Limits
from transports.h3_server import H3Listener, quic_configuration
from transports.tls import self_signed, server_context

MIB = 1024 * 1024
GW_MAX_BODY = 64 * 1024

# -- the in-process server -----------------------------------------------------------------------


class LimitsApp:
    """``/early``: 413 at once, the body unread. ``/hold``: counts, then waits for ``release`` (a
    disconnect does not end it: a slow app). Anything else: reads the body, answers 200."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        if path == "/hold":
            self.held += 1
            await self.release.wait()
        elif path != "/early":
            while (await receive()).get("more_body"):
                pass
        status, body = (413, b'{"error":"too large"}') if path == "/early" else (200, b"ok")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


class Running:
    def __init__(self, server: Server, app: LimitsApp, port: int) -> None:
        self.server = server
        self.app = app
        self.port = port

    @property
    def listener(self) -> H3Listener:
        assert self.server.h3 is not None
        return self.server.h3


@contextlib.asynccontextmanager
async def serving(tmp: Path, stall_s: float | None = 30.0, **limits: Any) -> AsyncIterator[Running]:
    cert, key = self_signed(tmp)
    app = LimitsApp()
    uv = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_config=None, access_log=False)
    extra = ExtraListeners(
        tls=server_context(cert, key), tls_port=0, quic=quic_configuration(cert, key),
        h3_limits=H3Limits(**limits), h3_stall_s=stall_s,
    )
    server = Server(uv, extra)
    task = asyncio.create_task(server.serve())
    listening = asyncio.ensure_future(server.listening.wait())
    await asyncio.wait([task, listening], return_when=asyncio.FIRST_COMPLETED)
    assert server.listening.is_set(), "the server did not start"
    try:
        yield Running(server, app, int(server.urls[2].rsplit(":", 1)[1]))
    finally:
        app.release.set()
        server.should_exit = True
        await task


async def eventually(condition: Any, timeout_s: float = 10.0) -> bool:
    """``wait_for`` off the event loop (the in-process server runs on it)."""
    return await asyncio.to_thread(wait_for, condition, timeout_s)


# -- early answers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A gateway with a 64 KiB body limit and a 1 s send-stall deadline on HTTP/3."""
    tmp = tmp_path_factory.mktemp("gw-h3-limits")
    cert, key = self_signed(tmp)
    port = free_tcp_and_udp_port()
    config = tls_config(fleet, cert, key, port)
    config["server"]["max_body_bytes"] = GW_MAX_BODY
    config["server"]["h3_limits"] = {"send_stall_s": 1.0}
    with GatewayProcess(config):
        yield port


CHAT_PREFIX = b'{"model":"llama-8b","messages":[{"role":"user","content":"hi"}],"stream":true,"pad":"'


async def test_an_oversized_upload_gets_its_413_as_chromium_would_see_it(gateway: int) -> None:
    report = await attacks.early_answer_upload(
        "127.0.0.1", gateway, path="/v1/chat/completions", body_size=4 * MIB, first=CHAT_PREFIX,
        headers=[(b"content-type", b"application/json")],
    )
    view = report.view
    assert view.status == 413 and view.ended and view.reset_code is None
    assert json.loads(bytes(view.body))["error"]["code"] == "request_too_large"
    # the rest of the upload was taken (and dropped), never stopped: the client finished its request
    assert view.stop_code is None and report.upload_finished and report.chromium_ok


async def test_a_grpc_web_oversized_message_gets_resource_exhausted(gateway: int) -> None:
    size = 4 * MIB
    frame_header = b"\x00" + size.to_bytes(4, "big")
    report = await attacks.early_answer_upload(
        "127.0.0.1", gateway, path="/sluicegate.v1.Inference/StreamChatCompletion", body_size=size + 5,
        first=frame_header, headers=[(b"content-type", b"application/grpc-web+proto"), (b"x-grpc-web", b"1")],
    )
    view = report.view
    assert view.status == 200 and view.ended and view.reset_code is None
    assert view.headers[b"grpc-status"] == b"8", view.headers  # RESOURCE_EXHAUSTED, Trailers-Only
    assert b"larger than the gateway" in view.headers[b"grpc-message"]
    assert view.stop_code is None and report.upload_finished and report.chromium_ok


async def test_an_upload_within_the_drain_budget_is_taken_to_its_end(tmp_path: Path) -> None:
    async with serving(tmp_path, drain_body_bytes=4 * MIB) as running:
        report = await attacks.early_answer_upload(
            "127.0.0.1", running.port, path="/early", body_size=2 * MIB
        )
        stats = running.listener.stats
        assert await eventually(lambda: stats.drains_completed == 1)
    assert report.view.status == 413 and bytes(report.view.body) == b'{"error":"too large"}'
    assert report.view.stop_code is None and report.chromium_ok and stats.drains_stopped == 0


async def test_past_the_drain_budget_the_upload_is_stopped_with_h3_no_error(tmp_path: Path) -> None:
    async with serving(tmp_path, drain_body_bytes=256 * 1024) as running:
        report = await attacks.early_answer_upload(
            "127.0.0.1", running.port, path="/early", body_size=8 * MIB
        )
        assert running.listener.stats.drains_stopped == 1
    view = report.view
    # the whole answer, then STOP_SENDING with H3_NO_ERROR; our response is never reset
    assert view.status == 413 and view.ended and bytes(view.body) == b'{"error":"too large"}'
    assert view.reset_code is None and view.stop_code == attacks.H3_NO_ERROR
    assert report.uploaded < 8 * MIB


async def test_stopping_the_upload_at_once_loses_the_answer_in_chromium(tmp_path: Path) -> None:
    """What the gateway did before (and HTTP/2 still does, where Chromium copes): STOP_SENDING right
    after the answer. It arrives while the upload waits for credit, which Chromium 156 fails."""
    async with serving(tmp_path, drain_body_bytes=0) as running:
        report = await attacks.early_answer_upload(
            "127.0.0.1", running.port, path="/early", body_size=8 * MIB
        )
    view = report.view
    assert view.status == 413 and view.ended and view.stop_code == attacks.H3_NO_ERROR
    assert view.stop_while_writing and not report.chromium_ok


# -- streams, connections, handshakes ------------------------------------------------------------


async def test_streams_over_the_per_connection_cap_are_refused(tmp_path: Path) -> None:
    async with serving(tmp_path, max_concurrent_streams=4) as running:
        # each request is cancelled at once, so QUIC gives the stream credit back while the app
        # (held here) still works on it: without our own count, this would pile up app tasks
        report = await attacks.stream_flood("127.0.0.1", running.port, streams=12, path="/hold")
        assert running.app.held == 4
        assert report.rejected == 8 and running.listener.stats.streams_rejected == 8
        assert report.closed_code is None  # the connection itself is fine
        running.app.release.set()
        async with attacks.h3_peer("127.0.0.1", running.port) as peer:
            sid = peer.request(attacks.request_headers("/ok"), b"x")
            assert await peer.until(lambda: peer.streams[sid].ended, 5)
            assert peer.streams[sid].status == 200


async def test_initials_beyond_the_connection_table_are_dropped(tmp_path: Path) -> None:
    async with serving(tmp_path, max_connections=5, retry="never") as running:
        report = await attacks.initial_flood("127.0.0.1", running.port, count=20, wait_s=1.0)
        stats = running.listener.stats
        assert report.sent == 20 and report.answered == 5 and report.unanswered == 15
        assert stats.initials_dropped == 15 and stats.connections == 5


async def test_a_handshake_flood_gets_retries_and_real_clients_still_connect(tmp_path: Path) -> None:
    async with serving(tmp_path, retry="auto", retry_above_handshakes=3) as running:
        report = await attacks.initial_flood("127.0.0.1", running.port, count=10, wait_s=1.0)
        assert report.answered == 3 and report.retried == 7
        assert running.listener.stats.connections == 3  # a Retry keeps no state
        # aioquic's client answers the Retry with its token, as browsers do
        async with attacks.h3_peer("127.0.0.1", running.port) as peer:
            sid = peer.request(attacks.request_headers("/ok"), b"x")
            assert await peer.until(lambda: peer.streams[sid].ended, 5)
            assert peer.streams[sid].status == 200
        assert running.listener.stats.retries_sent == 8


async def test_unfinished_handshakes_are_closed_after_the_handshake_timeout(tmp_path: Path) -> None:
    async with serving(tmp_path, handshake_timeout_s=0.5, retry="never") as running:
        stats = running.listener.stats
        report = await attacks.half_open("127.0.0.1", running.port, count=5, wait_s=3.0)
        assert report.answered == 5
        assert await eventually(lambda: stats.connections == 0)
        assert stats.handshakes_timed_out == 5 and stats.handshaking == 0
        # an established connection is not subject to it
        async with attacks.h3_peer("127.0.0.1", running.port) as peer:
            await asyncio.sleep(1.0)  # past the handshake deadline, on purpose
            sid = peer.request(attacks.request_headers("/ok"), b"x")
            assert await peer.until(lambda: peer.streams[sid].ended, 5)
        assert stats.handshakes_timed_out == 5


@pytest.mark.parametrize(("offset", "kept"), [(1000, True), (100_000, False)])
async def test_crypto_data_far_ahead_ends_the_connection(tmp_path: Path, offset: int, kept: bool) -> None:
    # aioquic's own bound is 512 KiB (and it allocates up to the offset claimed); ours, 16 KiB
    async with serving(tmp_path, handshake_timeout_s=30) as running:
        stats = running.listener.stats
        sent = await attacks.crypto_offset("127.0.0.1", running.port, offset=offset)
        assert sent >= 1200
        assert await eventually(lambda: stats.connections == 1 or stats.handshakes_timed_out > 0, 2)
        closed = await eventually(lambda: stats.connections == 0, 3.0)
        assert closed is not kept and stats.handshakes_timed_out == 0


# -- the send-stall deadline ---------------------------------------------------------------------


async def test_a_client_that_never_grants_credit_is_reset_and_the_pod_aborted(
    fleet: Fleet, gateway: int
) -> None:
    before = pod_aborts(fleet)
    started = time.monotonic()
    report = await attacks.never_reading(
        "127.0.0.1", gateway, headers=[(b"x-request-id", b"h3-never-reads")], timeout_s=30
    )
    view = report.view
    assert view.status == 200 and report.received <= 32 * 1024  # what our windows let through
    assert view.reset_code == attacks.H3_REQUEST_CANCELLED
    assert time.monotonic() - started < 20  # 1 s stall deadline, with a generous margin
    assert await asyncio.to_thread(wait_for, lambda: pod_aborts(fleet) > before)
