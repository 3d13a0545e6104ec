"""The hpack patches the gateway carries (``transports.h2_hpack``): hpack's results, exactly, and
no debug records; the remembered Huffman decodings stay bounded."""

from __future__ import annotations

import logging

import pytest
from hpack import Decoder, Encoder
from hpack.exceptions import HPACKDecodingError
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import h2_hpack

_CODER = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


@settings(max_examples=300, deadline=None)
@given(plain=st.binary(max_size=300), twice=st.booleans())
def test_a_remembered_decoding_is_hpacks(plain: bytes, twice: bool) -> None:
    coded = _CODER.encode(plain)
    assert h2_hpack.decode_huffman_remembered(coded) == decode_huffman(coded) == plain
    if twice:  # from the table the second time
        assert h2_hpack.decode_huffman_remembered(coded) == plain


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
                h2_hpack.decode_huffman_remembered(coded)
        else:
            assert h2_hpack.decode_huffman_remembered(coded) == expected


def test_the_table_stays_bounded_under_a_flood_of_distinct_literals() -> None:
    for n in range(3 * h2_hpack.CACHE_ENTRIES):
        h2_hpack.decode_huffman_remembered(_CODER.encode(b"value-%d" % n))
    assert 0 < len(h2_hpack._decoded) <= h2_hpack.CACHE_ENTRIES


def test_headers_round_trip_through_the_patched_hpack_without_debug_records(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h2_hpack.apply()
    h2_hpack.apply()  # idempotent
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("authorization", "Bearer sk-test-1"),
               ("content-type", "application/json"), ("user-agent", "OpenAI/Python 1.0")]
    encoder, decoder = Encoder(), Decoder()
    with caplog.at_level(logging.DEBUG, logger="hpack"):
        for _ in range(3):  # the first block adds to the tables, the next ones index and repeat literals
            block = encoder.encode(headers, huffman=True)
            assert decoder.decode(block) == headers
    assert [r for r in caplog.records if r.name.startswith("hpack")] == []
