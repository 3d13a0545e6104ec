"""Patches the gateway carries for h2 4.x and hpack 4.x, its header compression.

cProfile of one HTTP/2 request (h2load, every feature on; ``docs/benchmarks.md``) put h2 and hpack
at ~460 of its ~1700 Python calls; five things there cost far more than the work they do:

- **Huffman decoding, remembered.** hpack decodes a Huffman-coded literal in Python, one table step
  per nibble: its most expensive function, three calls a request. Clients send the same literals
  again and again without indexing them (h2load sends three a request; an API key is usually sent
  never-indexed, as RFC 7541 section 7.1.3 asks for secrets), so the decoded bytes of short literals
  are kept, keyed by their coded bytes, in a bounded table that is emptied when full.
- **Debug logging, off.** Every integer encoded or decoded and every header added to a table calls
  ``log.debug`` (~50 times a request), each two Python frames through ``logging`` for a record that
  is never kept. hpack's module loggers are replaced by one whose ``debug`` does nothing; its other
  levels still log.
- **h2's check of received header characters, a byte at a time.** RFC 9113 section 8.2.1 forbids
  some bytes in field names and values; h2 tests each byte of every request header in a Python
  loop. Here a header whose name and value pass one ``bytes.translate`` each goes through at once;
  any other goes through h2's own check, which raises its own error.
- **h2's checks of a received request's headers, eight generators deep.** A request block that
  passes every check is checked in one loop; any other goes through h2's own chain and its error.
- **h2's rebuilding of response headers.** Before encoding, h2 rebuilds every header tuple with
  two conversion calls a field; headers that are already 2-tuples of bytes (the gateway's) are
  kept as they are.

``apply()`` installs all five, once (``transports.h2_server`` calls it at import); results are h2's
and hpack's own, exactly (tests/test_h2_patches.py).
"""

from __future__ import annotations

import logging
from typing import Any

import h2.connection
import h2.exceptions
import h2.stream
import h2.utilities
import hpack.hpack
import hpack.table
from hpack.huffman_table import decode_huffman

from transports.asgi_stream import FIELD_VALUE_BYTES

CACHE_ENTRIES = 512  # distinct literals remembered at most (emptied when full: a flood gains nothing)
CACHE_LITERAL_BYTES = 256  # longer coded literals are decoded every time
_decoded: dict[bytes, bytes] = {}


def decode_huffman_remembered(coded: Any) -> bytes:
    """``hpack.huffman_table.decode_huffman``, remembering the results for short ``bytes`` literals."""
    if type(coded) is not bytes or len(coded) > CACHE_LITERAL_BYTES:
        return decode_huffman(coded)
    plain = _decoded.get(coded)
    if plain is None:
        plain = decode_huffman(coded)  # an invalid coding raises, and nothing is remembered
        if len(_decoded) >= CACHE_ENTRIES:
            _decoded.clear()
        _decoded[coded] = plain
    return plain


class _QuietDebug(logging.LoggerAdapter):  # type: ignore[type-arg]
    """hpack's logger without its debug records."""

    def debug(self, *args: object, **kwargs: Any) -> None:
        pass


_h2_reject_illegal_characters = h2.utilities._reject_illegal_characters
# RFC 9113 8.2.1: a name is visible ASCII but upper case (a colon only first: checked apart); a value
# has no NUL, LF or CR (``FIELD_VALUE_BYTES``; nor space or tab at its ends: checked apart).
_NAME_BYTES = bytes(b for b in range(0x21, 0x7F) if not 0x41 <= b <= 0x5A)
_SPACES = (0x20, 0x09)


def reject_illegal_characters(headers: Any, flags: Any) -> Any:
    """``h2.utilities._reject_illegal_characters``, one ``translate`` a name and a value for the
    usual header; any other header (or one not in bytes) is h2's to pass or refuse."""
    for header in headers:
        if _plain(header[0], header[1]):
            yield header
        else:
            yield from _h2_reject_illegal_characters((header,), flags)


def _plain(name: Any, value: Any) -> bool:
    if type(name) is not bytes or type(value) is not bytes:
        return False
    if name.translate(None, _NAME_BYTES) or name.find(b":", 1) != -1:
        return False
    return not value or (
        not value.translate(None, FIELD_VALUE_BYTES) and value[0] not in _SPACES and value[-1] not in _SPACES
    )


_h2_validate_headers = h2.utilities.validate_headers
_CONNECTION_HEADERS = h2.utilities.CONNECTION_HEADERS
_PSEUDO_HEADERS = h2.utilities._ALLOWED_PSEUDO_HEADER_FIELDS
_check_pseudo_headers = h2.utilities._check_pseudo_header_field_acceptability


def validate_headers(headers: Any, flags: Any) -> Any:
    """``h2.utilities.validate_headers`` for a received block: a request whose every header h2 would
    pass is checked in one loop and returned as it is; any other block (a response, trailers, or a
    request with anything h2 could refuse) goes through h2's own chain, which raises its own error.
    h2's chain is eight generators deep, each a Python frame resumed for every header."""
    headers = list(headers)
    if flags.is_response_header or flags.is_trailer or not _plain_request(headers, flags):
        return _h2_validate_headers(headers, flags)
    return headers


def _plain_request(headers: list[Any], flags: Any) -> bool:
    """Whether h2's checks would all pass ``headers``, a request's header block (RFC 9113 8.2-8.3):
    legal characters, no connection-specific field, TE only ``trailers``, pseudo-headers first,
    known, once each and as a request needs them, a non-empty ``:path``, and ``:authority`` or one
    ``Host``, equal when both are sent."""
    seen: set[bytes] = set()
    regular = False
    method = authority = host = None
    for header in headers:
        name, value = header[0], header[1]
        if not name or not _plain(name, value):
            return False
        if name[0] == 58:  # b":"
            if regular or name in seen or name not in _PSEUDO_HEADERS:
                return False
            seen.add(name)
            if name == b":method":
                method = value
            elif name == b":authority":
                authority = value
            elif name == b":path" and not value:
                return False
        else:
            regular = True
            if name in _CONNECTION_HEADERS or (name == b"te" and value.lower() != b"trailers"):
                return False
            if name == b"host":
                if host is not None:
                    return False
                host = value
    if authority is None and host is None:
        return False
    if authority is not None and host is not None and authority != host:
        return False
    try:
        _check_pseudo_headers(seen, method, flags)
    except h2.exceptions.ProtocolError:
        return False
    return True


_h2_utf8_encode_headers = h2.utilities.utf8_encode_headers


def utf8_encode_headers(headers: Any) -> list[Any]:
    """``h2.utilities.utf8_encode_headers`` as ``h2.stream`` calls it for every HEADERS sent: headers
    that are already 2-tuples of bytes come back as they are, in a list (h2 rebuilds each tuple with
    two calls a field); anything else goes through h2's own."""
    headers = list(headers)
    for header in headers:
        if type(header) is not tuple or len(header) != 2:
            return _h2_utf8_encode_headers(headers)
        name, value = header
        if type(name) is not bytes or type(value) is not bytes:
            return _h2_utf8_encode_headers(headers)
    return headers


def release(conn: h2.connection.H2Connection) -> None:
    """Let go of a finished connection's frame handlers.

    h2 keeps them as bound methods in a dict of the connection's own, so every connection is a
    reference cycle: its HPACK tables, stream map and buffers (~80 objects) outlive the protocol
    that let go of them until a collection of the generation they reached, for a connection that
    lived a while the full one. Called once the connection is lost: nothing is parsed after that."""
    table = getattr(conn, "_frame_dispatch_table", None)
    if isinstance(table, dict):
        table.clear()


def apply() -> None:
    """Install the patches (idempotent)."""
    hpack.hpack.decode_huffman = decode_huffman_remembered
    h2.utilities._reject_illegal_characters = reject_illegal_characters
    h2.stream.utf8_encode_headers = utf8_encode_headers
    h2.stream.validate_headers = validate_headers
    for module in (hpack.hpack, hpack.table):
        if not isinstance(module.log, _QuietDebug):
            module.log = _QuietDebug(module.log, {})
