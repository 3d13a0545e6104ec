"""The sans-IO gRPC-Web codec (transports/grpc_web.py), and the generated protobuf code kept in step."""

from __future__ import annotations

import base64
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from transports import grpc_web as codec
from transports.grpc_web import Status

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "sluicegate" / "v1" / "inference.proto"
GENERATED = ROOT / "transports" / "proto" / "sluicegate" / "v1"


# -- frames --------------------------------------------------------------------------------------


def test_a_message_frame_is_a_flag_a_big_endian_length_and_the_payload() -> None:
    assert codec.encode_message(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert codec.encode_frame(b"", codec.FLAG_TRAILERS) == b"\x80\x00\x00\x00\x00"
    big = b"x" * 70000
    assert codec.encode_message(big)[:5] == b"\x00" + struct.pack(">I", 70000)


def test_the_deframer_reassembles_frames_split_at_every_byte() -> None:
    stream = codec.encode_message(b"one") + codec.encode_message(b"") + codec.encode_trailers(Status.OK)
    deframer = codec.Deframer()
    frames = []
    for i in range(len(stream)):
        frames += deframer.feed(stream[i : i + 1])
    assert [f.payload for f in frames[:2]] == [b"one", b""]
    assert frames[2].is_trailers and not frames[0].is_trailers
    assert codec.parse_trailers(frames[2].payload) == {"grpc-status": "0"}
    assert deframer.pending == 0


def test_the_deframer_refuses_an_oversized_frame_before_buffering_it() -> None:
    deframer = codec.Deframer(max_payload=10)
    with pytest.raises(codec.ProtocolError, match="over the limit"):
        deframer.feed(b"\x00\x00\x00\x10\x00")  # declares 4096 bytes, only the header has arrived


def test_a_body_that_ends_inside_a_frame_is_an_error() -> None:
    with pytest.raises(codec.ProtocolError, match="ends inside a frame"):
        codec.decode_frames(codec.encode_message(b"hello")[:-1])
    assert codec.decode_frames(codec.encode_frame(b"z", codec.FLAG_COMPRESSED))[0].is_compressed


# -- trailers and grpc-message ---------------------------------------------------------------------


def test_trailers_carry_status_and_a_percent_encoded_message() -> None:
    frame = codec.encode_trailers(Status.RESOURCE_EXHAUSTED, "full: 100% of KV\r\ncache — retry")
    flag, length = struct.unpack(">BI", frame[:5])
    block = frame[5:]
    assert flag == 0x80 and length == len(block)
    assert block == b"grpc-status:8\r\ngrpc-message:full: 100%25 of KV%0D%0Acache %E2%80%94 retry\r\n"
    assert codec.parse_trailers(block) == {
        "grpc-status": "8",
        "grpc-message": "full: 100% of KV\r\ncache — retry",
    }


def test_trailers_only_headers_and_percent_decoding_edge_cases() -> None:
    assert codec.trailers_only_headers(Status.OK) == [(b"grpc-status", b"0")]
    assert codec.trailers_only_headers(Status.NOT_FOUND, "no model 'x'")[1] == (
        b"grpc-message",
        b"no model 'x'",
    )
    assert codec.percent_decode(b"50%25 %zz %4") == "50% %zz %4"  # bad escapes are kept as they are
    assert codec.percent_decode(b"caf%C3%A9") == "café"
    with pytest.raises(codec.ProtocolError):
        codec.parse_trailers(b"no colon here\r\n")


# -- grpc-web-text -------------------------------------------------------------------------------


def test_text_mode_decodes_any_split_and_concatenated_padded_segments() -> None:
    frames = [codec.encode_message(b"first"), codec.encode_message(b"second!"), codec.encode_trailers(0)]
    # a server that encodes each write on its own, padding included (as Envoy and this gateway do)
    body = b"".join(base64.b64encode(f) for f in frames)
    assert b"=" in body[:-4]
    expected = b"".join(frames)
    assert codec.decode_text(body) == expected
    for size in (1, 3, 5, 7):
        decoder = codec.TextDecoder()
        out = b"".join(decoder.feed(body[i : i + size]) for i in range(0, len(body), size))
        decoder.close()
        assert out == expected
    assert codec.decode_text(b"AAAA\r\nAAEA\n") == b"\x00" * 4 + b"\x01\x00"  # whitespace is ignored


def test_text_mode_refuses_bad_base64_and_a_truncated_group() -> None:
    with pytest.raises(codec.ProtocolError, match="invalid base64"):
        codec.decode_text(b"AA*A")
    with pytest.raises(codec.ProtocolError, match="4-character group"):
        codec.decode_text(b"AAAAAA")


def test_content_types() -> None:
    assert codec.text_mode(b"application/grpc-web") is False
    assert codec.text_mode(b"application/grpc-web+proto") is False
    assert codec.text_mode(b"Application/GRPC-Web-Text; charset=utf-8") is True
    assert codec.text_mode(b"application/grpc-web-text+proto") is True
    for other in (b"application/grpc-web+json", b"application/grpc", b"application/json", b""):
        assert codec.text_mode(other) is None
    assert codec.response_content_type(True) == b"application/grpc-web-text+proto"


# -- grpc-timeout --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"10S", 10.0),
        (b"500m", 0.5),
        (b"2M", 120.0),
        (b"1H", 3600.0),
        (b"250000u", 0.25),
        (b"99999999n", 0.099999999),
    ],
)
def test_grpc_timeout_values(value: bytes, seconds: float) -> None:
    assert codec.parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [b"", b"10", b"S", b"-1S", b"123456789S", b"1.5S", b"10s", b"10 S"])
def test_invalid_grpc_timeouts(value: bytes) -> None:
    with pytest.raises(codec.ProtocolError):
        codec.parse_timeout(value)


def test_format_timeout_round_trips() -> None:
    for seconds in (0.0005, 0.3, 7, 90000, 10**9):
        assert codec.parse_timeout(codec.format_timeout(seconds)) == pytest.approx(seconds, rel=1e-6)
    assert codec.format_timeout(0.3) == b"300000u"


# -- status codes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("http", "code"),
    [
        (400, Status.INVALID_ARGUMENT),
        (401, Status.UNAUTHENTICATED),
        (403, Status.PERMISSION_DENIED),
        (404, Status.NOT_FOUND),
        (405, Status.UNIMPLEMENTED),
        (413, Status.RESOURCE_EXHAUSTED),
        (429, Status.RESOURCE_EXHAUSTED),
        (499, Status.CANCELLED),
        (500, Status.INTERNAL),
        (502, Status.UNAVAILABLE),
        (503, Status.UNAVAILABLE),
        (504, Status.DEADLINE_EXCEEDED),
        (418, Status.UNKNOWN),
        (507, Status.INTERNAL),
    ],
)
def test_http_statuses_map_to_the_grpc_code_with_the_same_meaning(http: int, code: Status) -> None:
    assert codec.status_for_http(http) == code


def test_errors_map_by_type_and_mid_stream_by_their_own_code() -> None:
    assert codec.status_for_error(504, "timeout", "first_token") == Status.DEADLINE_EXCEEDED
    assert codec.status_for_error(None, "timeout", "stall") == Status.DEADLINE_EXCEEDED  # an SSE error event
    assert codec.status_for_error(None, "InternalServerError", 500) == Status.INTERNAL  # vLLM's event
    assert codec.status_for_error(None, "upstream_error", "bad_gateway") == Status.UNAVAILABLE
    assert codec.status_for_error(None, "service_unavailable", "shutting_down") == Status.UNAVAILABLE
    assert codec.status_for_error(None, "something_else", None) == Status.INTERNAL
    assert codec.status_for_error(429, "rate_limit_exceeded", "pressure") == Status.RESOURCE_EXHAUSTED


# -- generated code ------------------------------------------------------------------------------


def test_generated_python_matches_the_proto(tmp_path: Path) -> None:
    """transports/proto/ is what grpcio-tools' protoc makes of proto/ today: regenerate and compare."""
    from google.protobuf import descriptor_pb2

    from transports.proto.sluicegate.v1 import inference_pb2

    out = tmp_path / "out"
    out.mkdir()
    descriptor_set = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}",
            f"--pyi_out={out}", f"--descriptor_set_out={descriptor_set}", str(PROTO),
        ],
        check=True,
    )  # fmt: skip
    # The descriptor (what the wire format depends on) must match whatever protoc version runs this.
    fresh = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file[0]
    for message in fresh.message_type:  # --python_out embeds the descriptor without JSON names
        for field in message.field:
            field.ClearField("json_name")
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(inference_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == checked_in, "proto/ changed: regenerate transports/proto (see docs/grpc-web.md)"
    # The files themselves match when this protoc is the one that made them.
    for name in ("inference_pb2.py", "inference_pb2.pyi"):
        new = (out / "sluicegate" / "v1" / name).read_text()
        old = (GENERATED / name).read_text()
        if _gencode_version(new) != _gencode_version(old):
            versions = f"{_gencode_version(new)}, checked in: {_gencode_version(old)}"
            pytest.skip(f"the installed grpcio-tools makes protobuf {versions}")
        assert new == old, (
            f"{name} differs from protoc's output: regenerate transports/proto (see docs/grpc-web.md)"
        )


def _gencode_version(source: str) -> str:
    for line in source.splitlines():
        if line.startswith("# Protobuf Python Version:"):
            return line.split(":", 1)[1].strip()
    return "?"
