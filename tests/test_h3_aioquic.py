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
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.quic.stream import QuicStreamSender

from transports import h3_aioquic
from transports.tls import self_signed

CLIENT, SERVER = ("10.0.0.1", 1234), ("10.0.0.2", 443)
STREAMS = 60
WINDOW = 64 * 1024
UPLOAD = 3 * WINDOW
TOKEN = 230


def _pair(cert: Path, key: Path) -> tuple[QuicConnection, QuicConnection]:
    client = QuicConnection(
        configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, verify_mode=0)
    )
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, max_stream_data=WINDOW)
    config.load_cert_chain(str(cert), str(key))
    server = QuicConnection(
        configuration=config, original_destination_connection_id=client.original_destination_connection_id
    )
    return client, server


def _exchange(cert: Path, key: Path) -> dict[str, Any]:
    now = 1000.0
    client, server = _pair(cert, key)
    received: dict[int, bytearray] = {}
    uploaded: dict[int, int] = {}
    resets: list[int] = []
    sizes: list[int] = []  # the server's datagrams

    def pump() -> None:
        nonlocal now
        for _ in range(200):
            now += 0.001
            moved = False
            for data, _ in client.datagrams_to_send(now=now):
                server.receive_datagram(data, CLIENT, now=now)
                moved = True
            for data, _ in server.datagrams_to_send(now=now):
                sizes.append(len(data))
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
                # a chunk the size of an OpenAI SSE event: a round fills several packets
                server.send_stream_data(sid, b"token %d of stream %d;" % (token, sid) + b"x" * TOKEN)
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
        "datagrams": len(sizes),
        "bytes_sent": sum(sizes),
    }


def _packing(run: dict[str, Any]) -> tuple[int, int]:
    return run.pop("datagrams"), run.pop("bytes_sent")


def test_the_patched_aioquic_delivers_what_aioquic_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    monkeypatch.setattr(QuicStreamSender, "get_frame", h3_aioquic._aioquic_get_frame)
    monkeypatch.setattr(QuicConnection, "_write_application", h3_aioquic._aioquic_write_application)
    monkeypatch.setattr(QuicPacketPacer, "update_rate", h3_aioquic._aioquic_update_rate)
    theirs = _exchange(cert, key)
    h3_aioquic.apply()
    assert QuicConnection._write_application is h3_aioquic._write_application
    ours = _exchange(cert, key)

    # as many datagrams, as full: packets filled as aioquic fills them (a few bytes move from run
    # to run, aioquic's own runs included: the handshake's and the ACKs' sizes)
    (datagrams, sent), (their_datagrams, their_sent) = _packing(ours), _packing(theirs)
    assert abs(datagrams - their_datagrams) <= their_datagrams // 100
    assert abs(sent - their_sent) <= their_sent // 1000
    assert ours == theirs
    assert len(ours["received"]) == STREAMS
    ended = [data.endswith(b"[DONE]") for sid, data in ours["received"].items() if sid not in ours["resets"]]
    assert ended == [True] * (STREAMS - 1)
    assert ours["resets"] == [8 * 4 - 4]  # sids[7]: client bidi streams are 0, 4, 8, ...
    assert ours["uploaded"] == UPLOAD  # MAX_STREAM_DATA went out among idle streams
    # finished streams were discarded: left are the upload and the reset one (its request FIN came)
    assert len(ours["open"]) <= 2


def _one_transmit(
    cert: Path, key: Path, *, streams: int, chunks: int, slack: int | None = None, paced: int | None = None
) -> tuple[list[int], QuicConnection]:
    """The sizes of the datagrams one ``datagrams_to_send`` gives for ``chunks`` SSE-sized chunks on
    each of ``streams`` streams, with the congestion window leaving ``slack`` bytes (pacing off)
    or the pacer letting ``paced`` packets go (window open); and the server connection."""
    now = 1000.0
    client, server = _pair(cert, key)
    client.connect(SERVER, now=now)
    sids = []
    for _ in range(streams):
        sids.append(client.get_next_available_stream_id())
        client.send_stream_data(sids[-1], b"request", end_stream=True)
    for _ in range(10):  # the handshake, then the requests
        now += 0.001
        for data, _ in client.datagrams_to_send(now=now):
            server.receive_datagram(data, CLIENT, now=now)
        for data, _ in server.datagrams_to_send(now=now):
            client.receive_datagram(data, SERVER, now=now)
    for sid in sids:
        server.send_stream_data(sid, b"x" * TOKEN * chunks)
    congestion, pacer = server._loss._cc, server._loss._pacer
    if slack is not None:
        congestion.congestion_window = congestion.bytes_in_flight + slack
        pacer.packet_time = None  # no pacing: the window alone decides
    if paced is not None:
        congestion.congestion_window = congestion.bytes_in_flight + 1_000_000
        pacer.packet_time = 0.001
        pacer.bucket_max = pacer.bucket_time = paced * pacer.packet_time
        pacer.evaluation_time = now
    return [len(data) for data, _ in server.datagrams_to_send(now=now)], server


@pytest.mark.timeout(30)
def test_a_congestion_window_with_no_room_for_a_frame_ends_the_transmit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packet-full stop never ends an empty packet: a fresh packet the window leaves no room in
    must end the transmit, as in aioquic, not start the packet again forever."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setattr(QuicStreamSender, "get_frame", h3_aioquic._aioquic_get_frame)
    monkeypatch.setattr(QuicConnection, "_write_application", h3_aioquic._aioquic_write_application)
    monkeypatch.setattr(QuicPacketPacer, "update_rate", h3_aioquic._aioquic_update_rate)
    monkeypatch.setattr(QuicConnection, "_write_stream_frame", h3_aioquic._aioquic_write_stream_frame)
    slacks = range(0, 2600, 11)
    theirs = [len(_one_transmit(cert, key, streams=12, chunks=1, slack=slack)[0]) for slack in slacks]
    h3_aioquic.apply()
    ours = [len(_one_transmit(cert, key, streams=12, chunks=1, slack=slack)[0]) for slack in slacks]
    assert ours == theirs
    assert theirs[0] == 0 and theirs[-1] >= 3  # the window ran from no packet to several


def test_a_paced_transmit_sends_as_many_packets_as_full_as_aioquic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packet the stop ends counts against the pacer as one aioquic's own loop ends does: the
    pacer's five packets go, as full, and not the whole window at once."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setattr(QuicStreamSender, "get_frame", h3_aioquic._aioquic_get_frame)
    monkeypatch.setattr(QuicConnection, "_write_application", h3_aioquic._aioquic_write_application)
    monkeypatch.setattr(QuicPacketPacer, "update_rate", h3_aioquic._aioquic_update_rate)
    monkeypatch.setattr(QuicConnection, "_write_stream_frame", h3_aioquic._aioquic_write_stream_frame)
    theirs, _ = _one_transmit(cert, key, streams=40, chunks=3, paced=5)
    h3_aioquic.apply()
    ours, server = _one_transmit(cert, key, streams=40, chunks=3, paced=5)
    assert ours == theirs
    assert len(theirs) == 5 and len(set(theirs)) == 1  # five packets, each filled to the same size
    # the stop is armed only inside the patched call: outside it a full packet must not raise
    assert server._stop_when_full is False


def _burst(update_rate: Any, window: int, rtt: float) -> int:
    """How many packets a pacer set by ``update_rate`` lets go at once with a full bucket."""
    pacer = QuicPacketPacer(max_datagram_size=1200)
    update_rate(pacer, window, rtt)
    now = 10.0
    pacer.bucket_time, pacer.evaluation_time = pacer.bucket_max, now  # a while since the last send
    sent = 0
    while pacer.next_send_time(now) is None and sent < 1000:
        pacer.update_after_send(now)
        sent += 1
    return sent


@pytest.mark.parametrize(
    ("window", "rtt"), [(60_000, 0.010), (900_000, 0.0018), (5_200_000, 0.0016), (20_000_000, 0.0016)]
)
def test_the_pacer_lets_its_whole_burst_go_however_fast_the_connection(window: int, rtt: float) -> None:
    """aioquic's pacer lets a burst go at once (16 packets, or a quarter of the window), then one a
    packet time, and never counts a packet as less than 1 µs. Past a packet a microsecond its
    bucket held fewer packets the larger the window (the gateway's loopback connections: 6 at 5 MB
    and 1.6 ms), so a loaded connection woke on the pacing timer after every few. The patched
    pacer's burst is aioquic's below that rate and whole above it."""
    theirs = _burst(h3_aioquic._aioquic_update_rate, window, rtt)
    ours = _burst(h3_aioquic._update_rate, window, rtt)
    packets = max(2 * 1200, min(window // 4, 16 * 1200)) // 1200
    if 1200 / (window / rtt) >= 1e-6:  # below a packet a microsecond: aioquic's own bucket
        assert ours == theirs
        assert packets <= ours <= packets + 1
    else:
        assert packets <= ours <= packets + 1
        assert theirs < packets
