"""``json.loads`` for bytes, for the few parses every request pays (its body, the first token, usage).

``json.loads(some_bytes)`` detects the encoding (three ``startswith``), decodes, and around the C
scanner runs two regular expressions for the whitespace before and after the value: for the
short payloads of the request path that wrapping costs about as much as the parse (~2x the time of
the scanner alone, ``docs/benchmarks.md``). Here the scanner runs on the UTF-8 text directly; any
other input (another encoding, a BOM, leading whitespace, an error to explain) is left to
``json.loads``, so the result and every error are exactly its own.
"""

from __future__ import annotations

import json
from typing import Any

# the C scanner; it clears its memo after each call (not in typeshed's stubs)
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_JSON_SPACE = " \t\n\r"


def loads(data: bytes) -> Any:
    """What ``json.loads(data)`` returns or raises, faster for one UTF-8 JSON value."""
    try:
        text = data.decode()
        value, end = _scan(text, 0)
    except (UnicodeDecodeError, StopIteration, ValueError):
        return json.loads(data)
    if end != len(text) and text[end:].strip(_JSON_SPACE):
        return json.loads(data)  # something after the value: json.loads says what
    return value
