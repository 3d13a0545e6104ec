"""Two patches the gateway carries for hpack 4.x, the header compression under h2.

cProfile of one HTTP/2 request (h2load, every feature on; ``docs/benchmarks.md``) put hpack at 164
of its ~1700 Python calls, and two things in it did no work a request needs:

- **Huffman decoding, remembered.** hpack decodes a Huffman-coded literal in Python, one table step
  per nibble: its most expensive function, three calls a request. Clients send the same literals
  again and again without indexing them (h2load sends three a request; an API key is usually sent
  never-indexed, as RFC 7541 section 7.1.3 asks for secrets), so the decoded bytes of short literals
  are kept, keyed by their coded bytes, in a bounded table that is emptied when full.
- **Debug logging, off.** Every integer encoded or decoded and every header added to a table calls
  ``log.debug`` (~50 times a request), each two Python frames through ``logging`` for a record that
  is never kept. hpack's module loggers are replaced by one whose ``debug`` does nothing; its other
  levels still log.

``apply()`` installs both, once (``transports.h2_server`` calls it at import); results are hpack's
own, exactly (tests/test_h2_hpack.py).
"""

from __future__ import annotations

import logging
from typing import Any

import hpack.hpack
import hpack.table
from hpack.huffman_table import decode_huffman

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


def apply() -> None:
    """Install both patches (idempotent)."""
    hpack.hpack.decode_huffman = decode_huffman_remembered
    for module in (hpack.hpack, hpack.table):
        if not isinstance(module.log, _QuietDebug):
            module.log = _QuietDebug(module.log, {})
