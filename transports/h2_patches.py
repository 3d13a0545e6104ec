"""Patches the gateway carries for h2 4.x and hpack 4.x, its header compression.

cProfile of one HTTP/2 request (h2load, every feature on; ``docs/benchmarks.md``) put h2 and hpack
at ~460 of its ~1700 Python calls; four things there cost far more than the work they do:

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
- **h2's rebuilding of response headers.** Before encoding, h2 rebuilds every header tuple with
  two conversion calls a field; headers that are already 2-tuples of bytes (the gateway's) are
  kept as they are.

``apply()`` installs all four, once (``transports.h2_server`` calls it at import); results are h2's
and hpack's own, exactly (tests/test_h2_patches.py).
"""

from __future__ import annotations

import logging
from typing import Any

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


def apply() -> None:
    """Install the patches (idempotent)."""
    hpack.hpack.decode_huffman = decode_huffman_remembered
    h2.utilities._reject_illegal_characters = reject_illegal_characters
    h2.stream.utf8_encode_headers = utf8_encode_headers
    for module in (hpack.hpack, hpack.table):
        if not isinstance(module.log, _QuietDebug):
            module.log = _QuietDebug(module.log, {})
