"""transports.h3_server.write_data: a mid-stream DATA frame written straight to aioquic's stream
sender is what aioquic's own ``H3Connection.send_data`` writes, and anything else is left to it.

A client and a server ``H3Connection`` are wired back to back in memory, twice: one server answers
through aioquic's ``send_data`` only, the other through ``write_data``. The client must read the
same HTTP/3 events from both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.logger import QuicLogger

from transports.h3_server import _open_sender, write_data
from transports.tls import self_signed

CLIENT, SERVER = ("10.0.0.1", 1234), ("10.0.0.2", 443)


class _Pair:
    def __init__(self, cert: Path, key: Path, logger: QuicLogger | None = None) -> None:
        self.now = 1000.0
        self.client = QuicConnection(
            configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, verify_mode=0)
        )
        config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, quic_logger=logger)
        config.load_cert_chain(str(cert), str(key))
        original = self.client.original_destination_connection_id
        self.server = QuicConnection(configuration=config, original_destination_connection_id=original)
        self.client.connect(SERVER, now=self.now)
        self.pump()
        self.h3_client, self.h3_server = H3Connection(self.client), H3Connection(self.server)
        self.client_events: list[Any] = []

    def pump(self) -> None:
        for _ in range(50):
            self.now += 0.001
            moved = False
            for data, _ in self.client.datagrams_to_send(now=self.now):
                self.server.receive_datagram(data, CLIENT, now=self.now)
                moved = True
            for data, _ in self.server.datagrams_to_send(now=self.now):
                self.client.receive_datagram(data, SERVER, now=self.now)
                moved = True
            while (event := self.client.next_event()) is not None:
                if hasattr(self, "h3_client"):
                    self.client_events.extend(self.h3_client.handle_event(event))
            while (event := self.server.next_event()) is not None:
                if hasattr(self, "h3_server"):
                    self.h3_server.handle_event(event)
            if not moved:
                return

    def request(self) -> int:
        sid = self.client.get_next_available_stream_id()
        self.h3_client.send_headers(sid, [(b":method", b"POST"), (b":path", b"/v1/chat/completions"),
                                          (b":scheme", b"https"), (b":authority", b"x")], end_stream=True)
        self.pump()
        return sid


def _answer(pair: _Pair, short_way: bool) -> tuple[list[bool], dict[int, list[tuple[Any, ...]]]]:
    """Tokens on two streams, one answer ended with a DATA frame's FIN; whether the short way was
    taken for each write, and what the client read on each stream (aioquic's order between
    streams in a packet follows a set's, so it differs between any two runs)."""
    sids = [pair.request(), pair.request()]
    taken = []

    def send(sid: int, data: bytes, end: bool) -> None:
        if short_way:
            taken.append(write_data(pair.h3_server, pair.server, sid, data, end))
        else:
            pair.h3_server.send_data(sid, data, end)

    for sid in sids:
        assert _open_sender(pair.h3_server, pair.server, sid) is None  # no HEADERS sent yet
        pair.h3_server.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/event-stream")])
    for n in range(5):
        for sid in sids:
            send(sid, b"data: token %d\n\n" % n, False)
        pair.pump()
    send(sids[0], b"data: [DONE]\n\n", True)
    pair.h3_server.send_data(sids[1], b"", True)
    pair.pump()
    assert _open_sender(pair.h3_server, pair.server, sids[0]) is None  # ended: aioquic's to refuse
    read: dict[int, list[tuple[Any, ...]]] = {sid: [] for sid in sids}
    for e in pair.client_events:
        if isinstance(e, HeadersReceived):
            read[e.stream_id].append(("headers", e.stream_ended))
        elif isinstance(e, DataReceived):
            read[e.stream_id].append(("data", e.data, e.stream_ended))
    return taken, read


def test_the_short_way_writes_what_aioquic_writes(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    _, theirs = _answer(_Pair(cert, key), short_way=False)
    taken, ours = _answer(_Pair(cert, key), short_way=True)
    assert ours == theirs
    assert taken.count(True) == 10 and taken.count(False) == 1  # every token; not the ending write
    first, second = ours.values()
    assert first[-1] == ("data", b"data: [DONE]\n\n", True) and second[-1] == ("data", b"", True)
    assert [e[1] for e in first[1:-1]] == [b"data: token %d\n\n" % n for n in range(5)]


def test_a_quic_logger_keeps_aioquic_s_way(tmp_path: Path) -> None:
    """aioquic logs each DATA frame it creates when a QUIC logger is set: the short way would not."""
    cert, key = self_signed(tmp_path)
    taken, _ = _answer(_Pair(cert, key, logger=QuicLogger()), short_way=True)
    assert not any(taken)


def _after_a_reset(pair: _Pair, write: Any) -> str:
    """Reset a response past its HEADERS, as the gateway's abort does (QUIC only: HTTP/3 is not
    told), let the client acknowledge it, then write a token: the error raised."""
    sid = pair.request()
    pair.h3_server.send_headers(sid, [(b":status", b"200")])
    pair.pump()
    pair.server.reset_stream(sid, 0x10C)
    pair.pump()
    assert sid not in pair.server._streams  # acknowledged and discarded; HTTP/3 still past HEADERS
    try:
        write(sid, b"data: late\n\n")
    except Exception as exc:  # what each raises is the comparison
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_reset_and_discarded_stream_fails_as_aioquic_fails(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    theirs_pair, ours_pair = _Pair(cert, key), _Pair(cert, key)
    theirs = _after_a_reset(theirs_pair, lambda sid, data: theirs_pair.h3_server.send_data(sid, data, False))
    ours = _after_a_reset(
        ours_pair, lambda sid, data: write_data(ours_pair.h3_server, ours_pair.server, sid, data, False)
    )
    assert ours == theirs
    assert theirs.startswith("ValueError")  # one of h3_server's _SEND_ERRORS: the stream is lost
