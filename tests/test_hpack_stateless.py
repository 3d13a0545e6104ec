"""The gateway's HPACK encoder for responses (``transports.hpack_stateless``): what hpack's own
decoder reads back is what was encoded (nghttp2's decodes it too: curl in the HTTP/2 tests, h2load
in ``make bench``), the decoder's dynamic table stays empty, and what RFC 7541 asks of an encoder
that indexes nothing still holds: table-size updates and never-indexed fields."""

from __future__ import annotations

from typing import Any

import pytest
from hpack import Decoder, Encoder, HeaderTuple, NeverIndexedHeaderTuple
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import hpack_stateless
from transports.hpack_stateless import StatelessEncoder, encode_field

_NAMES = st.one_of(
    st.sampled_from([b":status", b"content-type", b"cache-control", b"server", b"date", b"x-request-id",
                     b"www-authenticate", b"x-ratelimit-remaining-tokens"]),
    st.binary(min_size=1, max_size=200).map(lambda b: b.lower()),  # long names: multi-byte lengths
)
_VALUES = st.one_of(st.sampled_from([b"200", b"404", b"", b"gzip, deflate", b"text/event-stream"]),
                    st.binary(max_size=300))


def _decode(decoder: Decoder, block: bytes) -> list[Any]:
    return decoder.decode(block, raw=True)


@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(st.lists(st.tuples(_NAMES, _VALUES), max_size=20), min_size=1, max_size=4))
def test_what_hpack_decodes_is_what_was_encoded_and_its_table_stays_empty(
    blocks: list[list[tuple[bytes, bytes]]],
) -> None:
    encoder, decoder = StatelessEncoder(), Decoder()
    for headers in blocks:
        assert _decode(decoder, encoder.encode(headers)) == headers
        assert len(decoder.header_table.dynamic_entries) == 0  # nothing for the peer to keep
        fresh = b"".join(encode_field(name, value) for name, value in headers)
        assert encoder.encode(headers) == fresh  # what is remembered is what a field encodes to


def test_each_field_takes_the_shortest_form_the_static_table_allows() -> None:
    assert encode_field(b":status", b"200") == b"\x88"  # whole field in the static table: index 8
    # name at static index 31: 4-bit prefix 15, then 16; no Huffman, length 17
    assert encode_field(b"content-type", b"text/event-stream") == b"\x0f\x10\x11text/event-stream"
    assert encode_field(b"age", b"1") == b"\x0f\x06\x011"  # index 21: 15 + 6
    assert encode_field(b"accept-charset", b"x") == b"\x0f\x00\x01x"  # index 15: the prefix exactly full
    assert encode_field(b"server", b"sg") == b"\x0f\x27\x02sg"  # index 54
    assert encode_field(b"x-a", b"b") == b"\x00\x03x-a\x01b"  # a literal name
    assert encode_field(b"x-a", b"b" * 130)[:7] == b"\x00\x03x-a\x7f\x03"  # 130 = 127 + 3


def test_a_never_indexed_field_keeps_its_form_and_the_decoder_says_so() -> None:
    encoder, decoder = StatelessEncoder(), Decoder()
    secret = [
        (b"set-cookie", b"a=1", True), NeverIndexedHeaderTuple(b"x-token", b"t"), (b":status", b"200", True),
    ]
    block = encoder.encode(secret)
    assert block[0] & 0xF0 == 0x10  # never indexed (RFC 7541 6.2.3), not the static index 55 alone
    decoded = decoder.decode(block, raw=True)
    assert decoded == [(b"set-cookie", b"a=1"), (b"x-token", b"t"), (b":status", b"200")]
    assert all(isinstance(h, NeverIndexedHeaderTuple) for h in decoded)
    plain = decoder.decode(encoder.encode([(b"set-cookie", b"a=1"), HeaderTuple(b"x-token", b"t")]), raw=True)
    assert not any(isinstance(h, NeverIndexedHeaderTuple) for h in plain)


def test_a_smaller_table_the_peer_allows_is_signalled_once_at_the_next_block() -> None:
    encoder, decoder = StatelessEncoder(), Decoder()
    encoder.header_table_size = 0  # what h2 does on SETTINGS_HEADER_TABLE_SIZE = 0
    block = encoder.encode([(b":status", b"200")])
    assert block == b"\x20\x88"  # a dynamic table size update to 0 (RFC 7541 6.3), then the field
    assert _decode(decoder, block) == [(b":status", b"200")]
    assert decoder.header_table.maxsize == 0
    assert encoder.encode([(b":status", b"200")]) == b"\x88"  # once only


def test_a_second_settings_of_the_same_size_still_gets_its_update() -> None:
    """h2 sets the size for every SETTINGS that carries it: the same value twice must not cancel the
    update the first one made due (a decoder such as nghttp2's would fail on the block without it)."""
    encoder = StatelessEncoder()
    encoder.header_table_size = 0
    encoder.header_table_size = 0
    assert encoder.encode([(b":status", b"200")]) == b"\x20\x88"


def test_values_that_compare_equal_are_never_confused() -> None:
    """1, True and 1.0 are equal keys, and a bytes subclass equals its bytes: none is remembered, so
    none can answer for another (hpack writes each as its text, as here)."""
    class Tagged(bytes):
        pass

    encoder = StatelessEncoder()
    assert Decoder().decode(encoder.encode([("x", 1), ("x", True), ("x", 1.0)])) == [
        ("x", "1"), ("x", "True"), ("x", "1.0")]
    encoder.encode([(b"x-a", Tagged(b"v"))])
    assert Decoder().decode(encoder.encode([(b"x-a", b"v")]), raw=True) == [(b"x-a", b"v")]


def test_a_dict_and_text_are_taken_as_hpack_takes_them() -> None:
    ours = StatelessEncoder().encode({"x-b": "2", ":status": 204})
    assert Decoder().decode(ours) == Decoder().decode(Encoder().encode({"x-b": "2", ":status": 204}))
    assert Decoder().decode(ours) == [(":status", "204"), ("x-b", "2")]


def test_the_remembered_fields_stay_bounded_under_a_flood_of_distinct_ones() -> None:
    encoder = StatelessEncoder()
    for n in range(3 * hpack_stateless.CACHE_ENTRIES):
        encoder.encode([(b"x-request-id", b"%d" % n)])
    assert 0 < len(hpack_stateless._fields) <= hpack_stateless.CACHE_ENTRIES


@pytest.mark.parametrize("size", [1, 40_000])
def test_h2_frames_our_blocks_and_a_peer_reads_them(size: int) -> None:
    """Through h2 itself, as the gateway's HTTP/2 server uses it, to an h2 client."""
    import h2.config
    import h2.connection
    import h2.events

    server = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=False, header_encoding=None, validate_outbound_headers=False,
        normalize_outbound_headers=False))
    server.encoder = StatelessEncoder()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.send_headers(1, [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
                            (b":authority", b"x")], end_stream=True)
    server.receive_data(client.data_to_send())
    answer = [(b":status", b"200"), (b"content-type", b"text/event-stream"), (b"x-big", b"v" * size)]
    server.send_headers(1, answer)
    events = client.receive_data(server.data_to_send())
    received = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert received and received[0].headers == answer  # 40 KB: CONTINUATION frames too
