"""Sans-IO gRPC-Web codec: frames, trailers, base64 text mode, timeouts, status codes.

gRPC-Web (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-WEB.md) carries gRPC over plain
HTTP/1.1 or HTTP/2 without HTTP trailers:

- a body is a sequence of frames, each ``flag (1 byte) + length (4 bytes, big-endian) + payload``;
  flag 0x00 is a message, 0x01 a compressed message, 0x80 the trailers;
- the trailers frame is last and holds HTTP/1-style header lines, ``grpc-status: N\\r\\n`` and
  ``grpc-message: <percent-encoded>\\r\\n``;
- an error before any message may instead be a *Trailers-Only* response: ``grpc-status`` and
  ``grpc-message`` in the HTTP headers and an empty body;
- ``application/grpc-web-text`` is the same byte stream in base64. A sender may pad and restart the
  base64 at any 4-character boundary (each response write here is encoded on its own), so decoders
  split at padding.

Pure functions and small state machines over bytes, like h2 and aioquic: no sockets, no ASGI.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from enum import IntEnum
from typing import NamedTuple

FLAG_MESSAGE = 0x00
FLAG_COMPRESSED = 0x01
FLAG_TRAILERS = 0x80
HEADER_SIZE = 5
MAX_FRAME = 0xFFFFFFFF

_HEADER = struct.Struct(">BI")

CONTENT_TYPE_PROTO = b"application/grpc-web+proto"
CONTENT_TYPE_TEXT = b"application/grpc-web-text+proto"


class Status(IntEnum):
    """gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ProtocolError(ValueError):
    """Bytes that are not valid gRPC-Web (bad frame, bad base64, bad timeout)."""


class FrameTooLarge(ProtocolError):
    """A frame declares more bytes than the receiver accepts."""


class Frame(NamedTuple):
    flag: int
    payload: bytes

    @property
    def is_trailers(self) -> bool:
        return bool(self.flag & FLAG_TRAILERS)

    @property
    def is_compressed(self) -> bool:
        return bool(self.flag & FLAG_COMPRESSED)


# -- content types ---------------------------------------------------------------------------------

_CONTENT_TYPES = {
    b"application/grpc-web": False,
    b"application/grpc-web+proto": False,
    b"application/grpc-web-text": True,
    b"application/grpc-web-text+proto": True,
}


def text_mode(content_type: bytes) -> bool | None:
    """True for base64 text mode, False for binary, None for anything this codec does not speak
    (including ``+json`` and other message codecs). Parameters after ``;`` are ignored."""
    return _CONTENT_TYPES.get(content_type.split(b";", 1)[0].strip().lower())


def response_content_type(text: bool) -> bytes:
    return CONTENT_TYPE_TEXT if text else CONTENT_TYPE_PROTO


# -- frames ------------------------------------------------------------------------------------------


def encode_frame(payload: bytes, flag: int = FLAG_MESSAGE) -> bytes:
    if len(payload) > MAX_FRAME:
        raise ProtocolError("a gRPC-Web frame holds at most 4 GiB")
    return _HEADER.pack(flag, len(payload)) + payload


def encode_message(payload: bytes) -> bytes:
    """One uncompressed message frame."""
    return _HEADER.pack(FLAG_MESSAGE, len(payload)) + payload


def trailer_block(status: int, message: str = "", extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The header lines of a trailers frame (or of Trailers-Only headers), lower-case names."""
    lines = [b"grpc-status:%d\r\n" % status]
    if message:
        lines.append(b"grpc-message:" + percent_encode(message) + b"\r\n")
    for name, value in extra:
        lines.append(f"{name.lower()}:{value}\r\n".encode("latin-1"))
    return b"".join(lines)


def encode_trailers(status: int, message: str = "", extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The final trailers frame (flag 0x80)."""
    return encode_frame(trailer_block(status, message, extra), FLAG_TRAILERS)


def trailers_only_headers(status: int, message: str = "") -> list[tuple[bytes, bytes]]:
    """The ``grpc-status``/``grpc-message`` response headers of a Trailers-Only answer."""
    headers = [(b"grpc-status", b"%d" % status)]
    if message:
        headers.append((b"grpc-message", percent_encode(message)))
    return headers


def parse_trailers(block: bytes) -> dict[str, str]:
    """A trailers frame's payload as a dict (names lower-cased, ``grpc-message`` decoded)."""
    out: dict[str, str] = {}
    for line in block.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise ProtocolError(f"malformed trailer line {line[:80]!r}")
        key = name.strip().lower().decode("latin-1")
        text = value.strip()
        out[key] = percent_decode(text) if key == "grpc-message" else text.decode("latin-1")
    return out


class Deframer:
    """Incremental frame parser: ``feed`` bytes as they arrive, get whole frames back.

    ``max_payload`` refuses a frame whose declared length is larger, before buffering it.
    """

    __slots__ = ("_buf", "max_payload")

    def __init__(self, max_payload: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_payload = max_payload

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        while len(buf) - pos >= HEADER_SIZE:
            flag, length = _HEADER.unpack_from(buf, pos)
            if length > self.max_payload:
                raise FrameTooLarge(f"frame of {length} bytes is over the limit of {self.max_payload}")
            end = pos + HEADER_SIZE + length
            if len(buf) < end:
                break
            frames.append(Frame(flag, bytes(buf[pos + HEADER_SIZE : end])))
            pos = end
        del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered (non-zero at the end means truncation)."""
        return len(self._buf)


def decode_frames(data: bytes, max_payload: int = MAX_FRAME) -> list[Frame]:
    """All frames of a complete body; a trailing partial frame is an error."""
    deframer = Deframer(max_payload)
    frames = deframer.feed(data)
    if deframer.pending:
        raise ProtocolError(f"body ends inside a frame ({deframer.pending} bytes left over)")
    return frames


# -- grpc-web-text -----------------------------------------------------------------------------------


def encode_text(data: bytes) -> bytes:
    """One base64 segment (padded); segments may be concatenated."""
    return base64.b64encode(data)


class TextDecoder:
    """Incremental base64 decoder for ``application/grpc-web-text`` bodies.

    Accepts arbitrary splits, whitespace, and concatenated padded segments (``QQ==QUI=``): decodes
    every complete 4-character group, and restarts after a group that carries padding.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + (data if not _has_space(data) else b"".join(data.split()))
        usable = len(buf) - len(buf) % 4
        self._buf = buf[usable:]
        return _decode_groups(buf[:usable])

    @property
    def pending(self) -> int:
        return len(self._buf)

    def close(self) -> None:
        if self._buf:
            raise ProtocolError("base64 body ends inside a 4-character group")


def decode_text(data: bytes) -> bytes:
    decoder = TextDecoder()
    out = decoder.feed(data)
    decoder.close()
    return out


def _has_space(data: bytes) -> bool:
    return b" " in data or b"\n" in data or b"\r" in data or b"\t" in data


def _decode_groups(data: bytes) -> bytes:
    try:
        if b"=" not in data[:-4]:  # the common case: one segment, padded at most at its end
            return binascii.a2b_base64(data, strict_mode=True)
        out = []
        pos = 0
        while pos < len(data):
            pad = data.find(b"=", pos)
            end = len(data) if pad == -1 else (pad // 4 + 1) * 4
            out.append(binascii.a2b_base64(data[pos:end], strict_mode=True))
            pos = end
        return b"".join(out)
    except binascii.Error as exc:
        raise ProtocolError(f"invalid base64 in a grpc-web-text body: {exc}") from None


# -- grpc-message percent-encoding -------------------------------------------------------------------

_SAFE = frozenset(range(0x20, 0x7F)) - {ord("%")}


def percent_encode(message: str) -> bytes:
    """UTF-8, then every byte outside printable ASCII (and ``%``) as ``%XX``, as gRPC specifies.

    A lone surrogate (JSON's ``"\\ud800"`` in a pod's error message decodes to one) becomes ``?``."""
    raw = message.encode("utf-8", "replace")
    if all(b in _SAFE for b in raw):
        return raw
    return b"".join(bytes((b,)) if b in _SAFE else b"%%%02X" % b for b in raw)


def percent_decode(value: bytes) -> str:
    """The inverse of ``percent_encode``; a malformed escape is kept as it is."""
    if b"%" not in value:
        return value.decode("utf-8", "replace")
    out = bytearray()
    i = 0
    while i < len(value):
        if value[i] == 0x25 and _is_hex(value[i + 1 : i + 3]):
            out.append(int(value[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(value[i])
            i += 1
    return out.decode("utf-8", "replace")


def _is_hex(pair: bytes) -> bool:
    return len(pair) == 2 and all(c in b"0123456789abcdefABCDEF" for c in pair)


# -- grpc-timeout ------------------------------------------------------------------------------------

_TIMEOUT = re.compile(rb"\s*(\d{1,8})([HMSmun])\s*")
_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float:
    """``grpc-timeout`` (at most 8 digits and a unit: H, M, S, m, u, n) in seconds."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise ProtocolError(f"invalid grpc-timeout {value[:40]!r}")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def format_timeout(seconds: float) -> bytes:
    """Seconds as a ``grpc-timeout`` value, in the finest unit that fits in 8 digits."""
    for unit, scale in ((b"n", 1e9), (b"u", 1e6), (b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        amount = round(seconds * scale)
        if amount < 100_000_000:
            return b"%d%b" % (max(amount, 1 if seconds > 0 else 0), unit)
    return b"99999999H"


# -- status codes ------------------------------------------------------------------------------------

# An HTTP status the gateway (or a pod) chose, as the gRPC code with the same meaning: the inverse of
# grpc-gateway's code → HTTP table (runtime/errors.go HTTPStatusFromCode), so "model not found"
# (404) is NOT_FOUND and "too many requests" (429) RESOURCE_EXHAUSTED. This is not the gRPC
# transport's own table for HTTP errors from a non-gRPC hop (doc/http-grpc-status-mapping.md, used
# by Envoy's httpToGrpcStatus: 404 UNIMPLEMENTED, 429 UNAVAILABLE), because these statuses carry the
# gateway's decisions, not a broken hop.
HTTP_TO_GRPC = {
    400: Status.INVALID_ARGUMENT,
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.NOT_FOUND,
    405: Status.UNIMPLEMENTED,
    408: Status.DEADLINE_EXCEEDED,
    409: Status.ABORTED,
    412: Status.FAILED_PRECONDITION,
    413: Status.RESOURCE_EXHAUSTED,  # as gRPC servers answer a message over their size limit
    415: Status.INVALID_ARGUMENT,
    422: Status.INVALID_ARGUMENT,
    429: Status.RESOURCE_EXHAUSTED,
    499: Status.CANCELLED,
    500: Status.INTERNAL,
    501: Status.UNIMPLEMENTED,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
    504: Status.DEADLINE_EXCEEDED,
}


def status_for_http(http_status: int) -> Status:
    """The table above; another 5xx is INTERNAL, anything else UNKNOWN (as gRPC's own table)."""
    code = HTTP_TO_GRPC.get(http_status)
    if code is not None:
        return code
    return Status.INTERNAL if 500 <= http_status < 600 else Status.UNKNOWN


def status_for_error(http_status: int | None, error_type: object = None, error_code: object = None) -> Status:
    """The gRPC code for an OpenAI error object, with its HTTP status when it had one.

    ``http_status`` is None for an error that ended a stream already under way (an SSE error
    event): then the error's own ``code`` (vLLM puts the HTTP status there) or ``type`` decides.
    """
    if error_type == "timeout":
        return Status.DEADLINE_EXCEEDED
    if http_status is not None:
        return status_for_http(http_status)
    if isinstance(error_code, int) and not isinstance(error_code, bool):
        return status_for_http(error_code)
    if error_type in ("upstream_error", "service_unavailable"):
        return Status.UNAVAILABLE
    if error_type == "rate_limit_exceeded":
        return Status.RESOURCE_EXHAUSTED
    return Status.INTERNAL
