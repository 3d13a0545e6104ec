"""The hpack patches the gateway carries (``transports.h2_patches``): hpack's results, exactly, and
no debug records; the remembered Huffman decodings stay bounded."""

from __future__ import annotations

import logging
from typing import Any

import h2.config
import h2.connection
import h2.exceptions
import h2.stream
import h2.utilities
import pytest
from hpack import Decoder, Encoder, HeaderTuple, NeverIndexedHeaderTuple
from hpack.exceptions import HPACKDecodingError
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import h2_patches

_CODER = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


@settings(max_examples=300, deadline=None)
@given(plain=st.binary(max_size=300), twice=st.booleans())
def test_a_remembered_decoding_is_hpacks(plain: bytes, twice: bool) -> None:
    coded = _CODER.encode(plain)
    assert h2_patches.decode_huffman_remembered(coded) == decode_huffman(coded) == plain
    if twice:  # from the table the second time
        assert h2_patches.decode_huffman_remembered(coded) == plain


@settings(max_examples=300, deadline=None)
@given(coded=st.binary(min_size=1, max_size=40))
def test_any_bytes_decode_or_fail_as_hpack_decides(coded: bytes) -> None:
    try:
        expected: bytes | type[Exception] = decode_huffman(coded)
    except HPACKDecodingError:
        expected = HPACKDecodingError
    for _ in range(2):  # a failure is never remembered as a result
        if expected is HPACKDecodingError:
            with pytest.raises(HPACKDecodingError):
                h2_patches.decode_huffman_remembered(coded)
        else:
            assert h2_patches.decode_huffman_remembered(coded) == expected


def test_the_table_stays_bounded_under_a_flood_of_distinct_literals() -> None:
    for n in range(3 * h2_patches.CACHE_ENTRIES):
        h2_patches.decode_huffman_remembered(_CODER.encode(b"value-%d" % n))
    assert 0 < len(h2_patches._decoded) <= h2_patches.CACHE_ENTRIES


def test_headers_round_trip_through_the_patched_hpack_without_debug_records(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h2_patches.apply()
    h2_patches.apply()  # idempotent
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("authorization", "Bearer sk-test-1"),
               ("content-type", "application/json"), ("user-agent", "OpenAI/Python 1.0")]
    encoder, decoder = Encoder(), Decoder()
    with caplog.at_level(logging.DEBUG, logger="hpack"):
        for _ in range(3):  # the first block adds to the tables, the next ones index and repeat literals
            block = encoder.encode(headers, huffman=True)
            assert decoder.decode(block) == headers
    assert [r for r in caplog.records if r.name.startswith("hpack")] == []


_NAME_CHOICES = st.sampled_from([b":path", b":method", b"content-type", b"authorization", b"x-a:b", b"X-Up",
                                 b"a b", b"caf\xc3\xa9", b"", b"\x7f", b"::x", b"user-agent"])
_VALUE_CHOICES = st.binary(max_size=16) | st.sampled_from(
    [b"Bearer sk-1", b" lead", b"trail\t", b"", b"a\x00"]
)


def _checked(check: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    try:
        return list(check(iter(headers), None))
    except h2.exceptions.ProtocolError as exc:
        return ("refused", str(exc))


@settings(max_examples=400, deadline=None)
@given(headers=st.lists(st.tuples(_NAME_CHOICES, _VALUE_CHOICES), max_size=6))
def test_received_headers_pass_or_fail_as_h2_decides(headers: list[tuple[bytes, bytes]]) -> None:
    ours = _checked(h2_patches.reject_illegal_characters, headers)
    assert ours == _checked(h2_patches._h2_reject_illegal_characters, headers)


def test_an_h2_server_still_refuses_a_request_header_with_a_newline() -> None:
    h2_patches.apply()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "x"),
                            ("x-bad", "a\nb")], end_stream=True)
    with pytest.raises(h2.exceptions.ProtocolError, match="Illegal character"):
        server.receive_data(client.data_to_send())


# -- h2's rebuilding of response headers ---------------------------------------------------------

_FIELD_PART = st.sampled_from([b"x-a", b"", "x-b", "caf\u00e9", 7, b"v\xff"])


@settings(max_examples=300, deadline=None)
@given(headers=st.lists(st.one_of(
    st.tuples(_FIELD_PART, _FIELD_PART),
    st.tuples(_FIELD_PART, _FIELD_PART, st.booleans()),
    st.builds(HeaderTuple, _FIELD_PART, _FIELD_PART),
    st.builds(NeverIndexedHeaderTuple, _FIELD_PART, _FIELD_PART),
), max_size=6))
def test_response_headers_are_taken_as_h2_takes_them(headers: list[Any]) -> None:
    def rebuilt(rebuild: Any) -> Any:
        try:
            out = rebuild(iter(headers))
        except Exception as exc:  # h2 refuses a field that is neither bytes nor text
            return type(exc)
        return out, [type(h) for h in out]  # never-indexed stays never-indexed

    assert rebuilt(h2_patches.utf8_encode_headers) == rebuilt(h2_patches._h2_utf8_encode_headers)


def test_they_are_what_h2_calls_once_applied() -> None:
    h2_patches.apply()
    assert h2.stream.utf8_encode_headers is h2_patches.utf8_encode_headers
    assert h2.stream.validate_headers is h2_patches.validate_headers


# -- h2's checks of a received request's headers ------------------------------------------------

_ANY_FIELD = st.tuples(
    st.sampled_from([b":method", b":scheme", b":path", b":authority", b":status", b":protocol", b":custom",
                     b"host", b"te", b"connection", b"keep-alive", b"cookie", b"x-a", b"X-Up", b"", b"a:b",
                     b"a b"]),
    st.sampled_from([b"GET", b"CONNECT", b"http", b"/", b"", b"x", b"y", b"trailers", b"TrailerS", b" pad",
                     b"a\nb", b"websocket"]),
)
_BENIGN_FIELD = st.tuples(st.sampled_from([b"content-type", b"x-a", b"cookie", b"accept", b"user-agent"]),
                          st.sampled_from([b"x", b"y", b"", b"application/json"]))
_FIELDS = st.lists(st.one_of(_BENIGN_FIELD, _BENIGN_FIELD, _BENIGN_FIELD, _ANY_FIELD).flatmap(
    lambda f: st.sampled_from([f, HeaderTuple(*f), NeverIndexedHeaderTuple(*f)])  # as hpack decodes them
), max_size=4)
_REQUEST_FLAGS = h2.utilities.HeaderValidationFlags(False, False, False, False)
_FLAGS = st.one_of(
    st.just(_REQUEST_FLAGS),
    st.builds(h2.utilities.HeaderValidationFlags, is_client=st.booleans(), is_trailer=st.booleans(),
              is_response_header=st.booleans(), is_push_promise=st.booleans()),
)
_USUAL = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"x")]


def _validated(validate: Any, headers: list[Any], flags: Any) -> Any:
    try:
        return list(validate(iter(headers), flags))
    except h2.exceptions.ProtocolError as exc:
        return ("refused", str(exc))


def _h2s_own(headers: list[Any], flags: Any) -> Any:
    """h2's chain as h2 ships it: its own character check too, not the patched one."""
    patched = h2.utilities._reject_illegal_characters
    h2.utilities._reject_illegal_characters = h2_patches._h2_reject_illegal_characters
    try:
        return _validated(h2_patches._h2_validate_headers, headers, flags)
    finally:
        h2.utilities._reject_illegal_characters = patched


@settings(max_examples=1500, deadline=None)
@given(lead=st.one_of(st.just([]), st.lists(_ANY_FIELD, max_size=2)), usual=st.booleans(), rest=_FIELDS,
       flags=_FLAGS)
def test_received_blocks_pass_or_fail_as_h2_decides(
    lead: list[tuple[bytes, bytes]], usual: bool, rest: list[tuple[bytes, bytes]], flags: Any
) -> None:
    """Blocks around a usual request (so that many pass), and blocks of anything."""
    headers = [*lead, *(_USUAL if usual else []), *rest]
    h2_patches.apply()
    assert _validated(h2_patches.validate_headers, headers, flags) == _h2s_own(headers, flags)


_M, _S, _P, _A = _USUAL


@pytest.mark.parametrize("headers", [
    [_M, _S, (b":path", b""), _A],  # an empty :path
    [*_USUAL, (b"host", b"x"), (b"host", b"x")],  # Host twice
    [*_USUAL, (b"host", b"y")],  # Host and :authority apart
    [_M, _S, _P, (b"host", b"x")],  # Host alone: enough
    [_M, _S, _P],  # neither
    [*_USUAL, (b"te", b"TrailerS")],  # TE is compared in lower case
    [*_USUAL, (b"te", b"gzip")],
    [*_USUAL, (b"connection", b"close")],
    [_M, (b"x-a", b"1"), _S, _P, _A],  # a pseudo-header after a regular one
    [(b":method", b"CONNECT"), _A],  # an ordinary CONNECT
    [(b":method", b"CONNECT"), _S, _P, _A],  # ... with :scheme and :path
    [(b":method", b"CONNECT"), (b":protocol", b"websocket"), _S, _P, _A],  # extended CONNECT
    [*_USUAL, (b":protocol", b"websocket")],  # :protocol without CONNECT
    [*_USUAL, (b":status", b"200")],  # a response's pseudo-header
    [*_USUAL, (b":custom", b"x")],  # one no RFC defines
    [*_USUAL, (b":path", b"/")],  # twice
    [*_USUAL, (b"", b"x")],  # an empty name
    [*_USUAL, (b"cookie", b"a=1"), (b"cookie", b"b=2")],
])
def test_each_rule_ends_as_h2s(headers: list[tuple[bytes, bytes]]) -> None:
    h2_patches.apply()
    ours = _validated(h2_patches.validate_headers, headers, _REQUEST_FLAGS)
    assert ours == _h2s_own(headers, _REQUEST_FLAGS)


def test_h2s_chain_is_still_the_one_the_loop_mirrors() -> None:
    """The one loop repeats h2 4.x's checks: a check h2 adds on an upgrade must be added there too."""
    assert h2.__version__.startswith("4.")
    assert {n for n in h2.utilities.validate_headers.__code__.co_names if n.startswith("_")} == {
        "_reject_illegal_characters", "_reject_empty_header_names", "_reject_te", "_reject_connection_header",
        "_reject_pseudo_header_fields", "_check_host_authority_header", "_check_path_header",
    }


def test_a_usual_request_takes_the_one_loop() -> None:
    headers = [*_USUAL, (b"content-type", b"application/json"), (b"te", b"trailers")]
    assert h2_patches._plain_request(headers, _REQUEST_FLAGS)
    assert h2_patches.validate_headers(iter(headers), _REQUEST_FLAGS) == headers
