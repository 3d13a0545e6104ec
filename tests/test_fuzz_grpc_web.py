"""Property tests of the gRPC-Web codec (transports/grpc_web.py): framing, base64 text mode, trailers,
timeouts. Arbitrary bytes in arbitrary splits give frames or ``ProtocolError`` and the same answer however
they were split; whatever the encoders produce, the decoders give back, in any chunking."""

from __future__ import annotations

import math
import struct

from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz_strategies import json_values, peak_bytes, splits
from transports import grpc_web as codec
from transports.grpc_web import Deframer, Frame, ProtocolError, Status, TextDecoder

flags = st.sampled_from([codec.FLAG_MESSAGE, codec.FLAG_COMPRESSED, codec.FLAG_TRAILERS])
flags |= st.integers(0, 255)
frames = st.lists(st.tuples(flags, st.binary(max_size=300)), max_size=6)
# text that gRPC status messages carry; lone surrogates come from a pod's JSON ("\ud800" is valid JSON)
messages = st.text(st.characters(exclude_categories=()), max_size=80)


def _with_splits(data: st.SearchStrategy[bytes]) -> st.SearchStrategy[tuple[bytes, list[bytes]]]:
    return data.flatmap(lambda body: st.tuples(st.just(body), splits(body)))


def _deframe(pieces: list[bytes], max_payload: int) -> tuple[list[Frame], int] | type[ProtocolError]:
    deframer = Deframer(max_payload)
    out: list[Frame] = []
    try:
        for piece in pieces:
            out += deframer.feed(piece)
    except codec.FrameTooLarge:
        return codec.FrameTooLarge
    return out, deframer.pending


def _untext(pieces: list[bytes]) -> bytes | type[ProtocolError]:
    decoder = TextDecoder()
    try:
        out = b"".join(decoder.feed(piece) for piece in pieces)
        decoder.close()
    except ProtocolError:
        return ProtocolError
    return out


# -- frames --------------------------------------------------------------------------------------


@given(_with_splits(st.binary(max_size=400)), st.sampled_from([0, 1, 16, 300, codec.MAX_FRAME]))
@example((b"\x00\xff\xff\xff\xff", [b"\x00\xff", b"\xff\xff\xff"]), 16)
def test_deframer_gives_the_same_frames_however_bytes_are_split(
    body_pieces: tuple[bytes, list[bytes]], max_payload: int
) -> None:
    body, pieces = body_pieces
    whole = _deframe([body], max_payload)
    assert _deframe(pieces, max_payload) == whole
    if whole is not codec.FrameTooLarge:
        got, pending = whole
        assert sum(codec.HEADER_SIZE + len(f.payload) for f in got) + pending == len(body)
        assert all(len(f.payload) <= max_payload for f in got)


@given(st.binary(max_size=400))
def test_decode_frames_returns_frames_or_raises_protocol_error(body: bytes) -> None:
    try:
        got = codec.decode_frames(body, 256)
    except ProtocolError:
        return
    assert b"".join(codec.encode_frame(f.payload, f.flag) for f in got) == body


def _encoded(sent: list[tuple[int, bytes]]) -> bytes:
    return b"".join(codec.encode_frame(payload, flag) for flag, payload in sent)


@given(frames.flatmap(lambda sent: st.tuples(st.just(sent), splits(_encoded(sent)))))
def test_encoded_frames_come_back_in_any_chunking(case: tuple[list[tuple[int, bytes]], list[bytes]]) -> None:
    sent, pieces = case
    assert _deframe(pieces, codec.MAX_FRAME) == ([Frame(f, p) for f, p in sent], 0)


def test_a_frame_declaring_4_gib_is_refused_before_any_of_it_is_buffered() -> None:
    deframer = Deframer(max_payload=1 << 20)
    try:
        deframer.feed(struct.pack(">BI", 0, codec.MAX_FRAME) + b"x" * 100)
    except codec.FrameTooLarge:
        pass
    else:
        raise AssertionError("a frame over max_payload was accepted")
    assert deframer.pending <= codec.HEADER_SIZE + 100


def test_deframer_memory_is_bounded_by_one_frame_and_one_read() -> None:
    """16 MiB of small frames fed in 64 KiB reads: the buffer never holds more than a read plus a frame."""
    read = b"".join(codec.encode_message(b"m" * 1000) for _ in range(64))  # ~64 KiB

    def run() -> int:
        deframer, count = Deframer(max_payload=4096), 0
        for _ in range(256):
            count += len(deframer.feed(read))
        return count

    count, peak = peak_bytes(run)
    assert count == 256 * 64
    assert peak < 8 * len(read)


# -- base64 text mode ------------------------------------------------------------------------------


text_bodies = st.one_of(
    st.binary(max_size=200),
    st.text(alphabet="ABCDabcd0189+/= \r\n\t", max_size=120).map(str.encode),
    st.lists(st.binary(max_size=20).map(codec.encode_text), max_size=6).map(b"".join),
)


@given(_with_splits(text_bodies))
@example((b"QQ==QUI=", [b"QQ=", b"=QU", b"I="]))
@example((b"====", [b"====", b""]))
@example((b"QQ==\x0bQUI=", [b"QQ==\x0bQUI="]))  # whitespace that bytes.split() drops but _has_space misses
def test_text_decoder_gives_the_same_bytes_however_the_base64_is_split(
    body_pieces: tuple[bytes, list[bytes]],
) -> None:
    body, pieces = body_pieces
    assert _untext(pieces) == _untext([body])


@given(
    st.lists(st.binary(max_size=60), max_size=8).flatmap(
        lambda segments: st.tuples(
            st.just(segments), splits(b"".join(codec.encode_text(s) for s in segments))
        )
    )
)
def test_encoded_text_segments_come_back_in_any_chunking(case: tuple[list[bytes], list[bytes]]) -> None:
    segments, pieces = case
    assert _untext(pieces) == b"".join(segments)


@given(st.lists(st.binary(max_size=80), max_size=5), st.data())
def test_messages_survive_framing_then_base64_written_per_response_write(
    payloads: list[bytes], data: st.DataObject
) -> None:
    """What the gateway's text mode sends (each write framed, then base64 on its own), read back."""
    stream = b"".join(codec.encode_message(p) for p in payloads) + codec.encode_trailers(Status.OK)
    writes = data.draw(splits(stream))
    wire = b"".join(codec.encode_text(w) for w in writes)
    pieces = data.draw(splits(wire))
    decoder, deframer, got = TextDecoder(), Deframer(), []
    for piece in pieces:
        got += deframer.feed(decoder.feed(piece))
    decoder.close()
    assert deframer.pending == 0
    assert [f.payload for f in got[:-1]] == payloads and got[-1].is_trailers
    assert codec.parse_trailers(got[-1].payload)["grpc-status"] == "0"


def test_text_decoder_output_is_three_quarters_of_its_input() -> None:
    body = codec.encode_text(b"\x00" * (3 << 20))
    decoder = TextDecoder()
    out, peak = peak_bytes(lambda: [decoder.feed(body[i : i + 65536]) for i in range(0, len(body), 65536)])
    assert sum(map(len, out)) == 3 << 20
    assert peak < 2 * (3 << 20)  # the output itself plus a read's worth


# -- trailers, grpc-message, grpc-timeout, status ----------------------------------------------------


@given(st.binary(max_size=300))
@example(b"grpc-message:%\r\n")
@example(b"grpc-message:%F\r\n")
@example(b"grpc-message:%ff%fe\r\n")
def test_parse_trailers_returns_strings_or_raises_protocol_error(block: bytes) -> None:
    try:
        got = codec.parse_trailers(block)
    except ProtocolError:
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in got.items())


@given(st.integers(0, 2**31), messages)
@example(0, "\ud800")  # found by fuzzing: a lone surrogate (from a pod's JSON) made percent_encode raise
@example(13, "100% done\r\nx-injected: 1")
def test_trailers_round_trip_status_and_message(status: int, message: str) -> None:
    block = codec.trailer_block(status, message)
    got = codec.parse_trailers(block)
    assert got["grpc-status"] == str(status)
    # spaces are sent as they are (as gRPC's own encoders do), so header parsing trims those at the ends
    expected = message.encode("utf-8", "replace").decode("utf-8").strip(" ") if message else None
    assert got.get("grpc-message") == expected
    assert block.count(b"\r\n") == (2 if message else 1)  # nothing in a message can add a header line


@given(messages)
def test_percent_encoding_is_printable_ascii_and_round_trips(message: str) -> None:
    encoded = codec.percent_encode(message)
    assert all(0x20 <= b < 0x7F for b in encoded)
    assert codec.percent_decode(encoded) == message.encode("utf-8", "replace").decode("utf-8")


@given(st.binary(max_size=40))
def test_percent_decode_never_raises(value: bytes) -> None:
    assert isinstance(codec.percent_decode(value), str)


@given(st.binary(max_size=20) | st.from_regex(rb"\A\s*\d{1,9}[HMSmunx]\s*\Z"))
def test_parse_timeout_is_a_non_negative_number_of_seconds_or_protocol_error(value: bytes) -> None:
    try:
        seconds = codec.parse_timeout(value)
    except ProtocolError:
        return
    assert 0 <= seconds <= 99999999 * 3600 and math.isfinite(seconds)


@given(st.floats(0, 99999999 * 3600))
def test_format_timeout_round_trips_to_within_its_unit(seconds: float) -> None:
    """Each unit is used from 100000 of it up (the finer one would need 9 digits): 5e-6 at worst."""
    back = codec.parse_timeout(codec.format_timeout(seconds))
    assert math.isclose(back, seconds, rel_tol=1e-5, abs_tol=1e-9)
    assert (back > 0) == (seconds > 0)


@given(st.binary(max_size=60))
def test_text_mode_is_true_false_or_none(content_type: bytes) -> None:
    assert codec.text_mode(content_type) in (True, False, None)


@given(st.none() | st.integers(), json_values(), json_values())
def test_any_error_object_maps_to_a_grpc_status(http_status: int | None, type_: object, code: object) -> None:
    assert isinstance(codec.status_for_error(http_status, type_, code), Status)
