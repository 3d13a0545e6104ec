"""transports.h3_aioquic against aioquic's own packet building: the same exchange, the same outcome.

A client and a server ``QuicConnection`` are wired back to back in memory (no sockets: the patches
are to aioquic's packet building, and only an in-memory pair makes both runs the same exchange).
The server streams tokens on 60 request streams, finishes them, resets one; one client uploads more
than its stream window, so the server must send MAX_STREAM_DATA while the others are idle. Both
runs must deliver the same bytes per stream, reset the same stream, grant the upload, and discard
the finished streams. The gateway's own HTTP/3 tests (test_h3_server, test_h3_limits) run the
patched aioquic over real sockets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamDataReceived, StreamReset
from aioquic.quic.stream import QuicStreamSender

from transports import h3_aioquic
from transports.tls import self_signed

CLIENT, SERVER = ("10.0.0.1", 1234), ("10.0.0.2", 443)
STREAMS = 60
WINDOW = 64 * 1024
UPLOAD = 3 * WINDOW


def _exchange(cert: Path, key: Path) -> dict[str, Any]:
    now = 1000.0
    client = QuicConnection(
        configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, verify_mode=0)
    )
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, max_stream_data=WINDOW)
    config.load_cert_chain(str(cert), str(key))
    server = QuicConnection(
        configuration=config, original_destination_connection_id=client.original_destination_connection_id
    )
    received: dict[int, bytearray] = {}
    uploaded: dict[int, int] = {}
    resets: list[int] = []

    def pump() -> None:
        nonlocal now
        for _ in range(200):
            now += 0.001
            moved = False
            for data, _ in client.datagrams_to_send(now=now):
                server.receive_datagram(data, CLIENT, now=now)
                moved = True
            for data, _ in server.datagrams_to_send(now=now):
                client.receive_datagram(data, SERVER, now=now)
                moved = True
            while (event := client.next_event()) is not None:
                if isinstance(event, StreamDataReceived):
                    received.setdefault(event.stream_id, bytearray()).extend(event.data)
                elif isinstance(event, StreamReset):
                    resets.append(event.stream_id)
            while (event := server.next_event()) is not None:
                if isinstance(event, StreamDataReceived):
                    uploaded[event.stream_id] = uploaded.get(event.stream_id, 0) + len(event.data)
            if not moved:
                return

    client.connect(SERVER, now=now)
    pump()
    sids = []
    for _ in range(STREAMS):
        sid = client.get_next_available_stream_id()
        client.send_stream_data(sid, b"request", end_stream=True)
        sids.append(sid)
    upload = client.get_next_available_stream_id()
    client.send_stream_data(upload, b"u" * UPLOAD, end_stream=False)
    pump()
    for token in range(40):
        for n, sid in enumerate(sids):
            if (token + n) % 3 == 0:
                server.send_stream_data(sid, b"token %d of stream %d;" % (token, sid))
        pump()
    uploaded_while_busy = uploaded.get(upload, 0)  # before the streams end, with 60 open
    server.reset_stream(sids[7], 0x10C)
    for sid in sids:
        if sid != sids[7]:
            server.send_stream_data(sid, b"[DONE]", end_stream=True)
    pump()
    return {
        "received": {sid: bytes(data) for sid, data in received.items()},
        "resets": resets,
        "uploaded": uploaded_while_busy,
        "open": sorted(server._streams),
    }


def test_the_patched_aioquic_delivers_what_aioquic_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    monkeypatch.setattr(QuicStreamSender, "get_frame", h3_aioquic._aioquic_get_frame)
    monkeypatch.setattr(QuicConnection, "_write_application", h3_aioquic._aioquic_write_application)
    theirs = _exchange(cert, key)
    h3_aioquic.apply()
    assert QuicConnection._write_application is h3_aioquic._write_application
    ours = _exchange(cert, key)

    assert ours == theirs
    assert len(ours["received"]) == STREAMS
    ended = [data.endswith(b"[DONE]") for sid, data in ours["received"].items() if sid not in ours["resets"]]
    assert ended == [True] * (STREAMS - 1)
    assert ours["resets"] == [8 * 4 - 4]  # sids[7]: client bidi streams are 0, 4, 8, ...
    assert ours["uploaded"] == UPLOAD  # MAX_STREAM_DATA went out among idle streams
    # finished streams were discarded: left are the upload and the reset one (its request FIN came)
    assert len(ours["open"]) <= 2
