"""HPACK for response headers without the dynamic table, the way nginx encodes them.

hpack's ``Encoder`` offers every field to the dynamic table and searches the table linearly for
each one it sends: with the gateway's ~13 response headers that was ~40 Python calls a header and
~7 % of an HTTP/2 request's CPU (cProfile, h2load, one stream of short requests), for table hits
that save ~150 bytes a response on a stream of tens of kilobytes.

Here every field is a literal *without indexing* (RFC 7541 section 6.2.2), its name a static-table
index where the static table has it, or a static index alone when the whole field is there
(``:status: 200``). A field's bytes then depend on nothing sent before, so they are remembered in a
bounded table and a header block is a join. The peer's decoder never adds an entry to its table.

What stays stateful is what RFC 7541 section 4.2 requires: a change of the table size the peer
allows (``SETTINGS_HEADER_TABLE_SIZE``, which h2 passes on to ``header_table_size``) is signalled
at the start of the next block, by hpack's own code. A never-indexed field (RFC 7541 section 7.1.3;
hpack's ``NeverIndexedHeaderTuple`` or a third tuple item that is true) keeps that form.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hpack import Encoder, HeaderTuple
from hpack.hpack import encode_integer
from hpack.table import HeaderTable

CACHE_ENTRIES = 1024  # distinct fields remembered at most (emptied when full: ids and counters churn it)
_fields: dict[tuple[bytes, bytes], bytes] = {}  # a (name, value) in bytes -> its field's bytes
_static_field: dict[tuple[bytes, bytes], int] = {}
_static_name: dict[bytes, int] = {}
for _index, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, start=1):
    _static_field.setdefault((_name, _value), _index)
    _static_name.setdefault(_name, _index)


def encode_field(name: bytes, value: bytes, never_indexed: bool = False) -> bytes:
    """One header field's representation, the same whatever was encoded before."""
    if not never_indexed:
        index = _static_field.get((name, value))
        if index is not None:
            return _INDEXED[index]
    index = _static_name.get(name, 0)
    head = (_NEVER_INDEXED if never_indexed else _WITHOUT_INDEXING)[index]
    if index:
        return b"".join((head, _length(len(value)), value))
    return b"".join((head, _length(len(name)), name, _length(len(value)), value))


def _length(n: int) -> bytes:
    """A string's length, its Huffman bit clear (RFC 7541 5.2): one byte below 127."""
    return _SHORT[n] if n < 127 else bytes(encode_integer(n, 7))


def _prefixed(index: int, flags: int) -> bytes:
    """A literal's first bytes: ``flags`` and the name's static index in a 4-bit prefix (6.2.2, 6.2.3)."""
    prefix = encode_integer(index, 4)
    prefix[0] |= flags
    return bytes(prefix)


_SHORT = [bytes((n,)) for n in range(127)]
_INDEXED = [bytes((0x80 | index,)) for index in range(len(HeaderTable.STATIC_TABLE) + 1)]  # 6.1, 7 bits
_WITHOUT_INDEXING = [_prefixed(index, 0x00) for index in range(len(HeaderTable.STATIC_TABLE) + 1)]
_NEVER_INDEXED = [_prefixed(index, 0x10) for index in range(len(HeaderTable.STATIC_TABLE) + 1)]


class StatelessEncoder(Encoder):
    """hpack's ``Encoder`` interface (h2 calls ``encode`` and sets ``header_table_size``), no Huffman
    coding and no dynamic table (module doc)."""

    def encode(self, headers: Iterable[Any], huffman: bool = False) -> bytes:
        if isinstance(headers, dict):  # as hpack does: a dict's pseudo-headers first, else in order
            headers = sorted(headers.items(), key=lambda field: not _as_bytes(field[0]).startswith(b":"))
        blocks: list[bytes] = []
        if self.table_size_changes:  # not ``resized``: a second SETTINGS of the same size clears that
            blocks.append(self._encode_table_size_change())
            self.header_table.resized = False
        fields = _fields
        for header in headers:
            # only a plain tuple of bytes is remembered: a HeaderTuple's never-indexed flag is no part
            # of the key, and values that compare equal (1, True, 1.0; a bytes subclass) encode apart
            if type(header) is not tuple or len(header) != 2 or type(header[0]) is not bytes or (
                type(header[1]) is not bytes
            ):
                blocks.append(_encode(header))
                continue
            block = fields.get(header)
            if block is None:
                block = _encode(header)
                if len(fields) >= CACHE_ENTRIES:
                    fields.clear()
                fields[header] = block
            blocks.append(block)
        return b"".join(blocks)


def _encode(header: Any) -> bytes:
    never = not header.indexable if isinstance(header, HeaderTuple) else len(header) > 2 and bool(header[2])
    return encode_field(_as_bytes(header[0]), _as_bytes(header[1]), never)


def _as_bytes(value: Any) -> bytes:
    """As hpack takes a name or value: bytes as they are, anything else as its text in UTF-8."""
    if type(value) is bytes:
        return value
    return (value if type(value) is str else str(value)).encode("utf-8")
