"""Sans-IO helpers for OpenAI-style Server-Sent Events streams.

The relay forwards a pod's SSE bytes untouched; these functions only *look* at them where a
decision needs it: has the first token arrived yet (so response headers can be held until then),
and what usage did the stream report at its end. Pure functions over bytes, testable alone.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"[DONE]"


class MalformedEvent(ValueError):
    """An SSE ``data:`` payload that is neither ``[DONE]`` nor a JSON object."""


def _event_end(buf: bytes, start: int) -> tuple[int, int]:
    """Offset of the blank line ending the event at ``start`` and its length, or (-1, 0)."""
    lf = buf.find(b"\n\n", start)
    crlf = buf.find(b"\r\n\r\n", start)
    if crlf != -1 and (lf == -1 or crlf < lf):
        return crlf, 4
    return (lf, 2) if lf != -1 else (-1, 0)


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` field of one event, or None for a comment/keep-alive event."""
    parts = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


def _carries_token(payload: dict[str, Any]) -> bool:
    if "error" in payload:
        return True
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") is not None or choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
        ):
            return True
    return False


def scan_first_token(buf: bytes, start: int = 0) -> tuple[bool, int]:
    """Look through the complete events in ``buf[start:]`` for the first one that matters.

    An event matters when the client would see something in it: content text, a tool call, a
    finish reason, an error, or the end of the stream. Role-only deltas (vLLM's opening chunk)
    and keep-alive comments do not. Returns ``(found, resume_at)``: where to continue scanning
    when more bytes arrive. Raises ``MalformedEvent`` for a payload that is not JSON.
    """
    pos = start
    while True:
        end, sep = _event_end(buf, pos)
        if end == -1:
            return False, pos
        data = event_data(buf[pos:end])
        pos = end + sep
        if data is None:
            continue
        if data.strip() == DONE:
            return True, pos
        try:
            payload = json.loads(data)
        except ValueError:
            raise MalformedEvent(data[:200].decode("utf-8", "replace")) from None
        if not isinstance(payload, dict):
            raise MalformedEvent(data[:200].decode("utf-8", "replace"))
        if _carries_token(payload):
            return True, pos


def find_usage(tail: bytes) -> dict[str, int] | None:
    """The ``usage`` object of the last event in ``tail`` that has one (the stream's final chunk)."""
    at = tail.rfind(b'"usage"')
    if at == -1:
        return None
    begin = tail.rfind(b"data:", 0, at)
    if begin == -1:
        return None
    end, _ = _event_end(tail, begin)
    data = event_data(tail[begin : end if end != -1 else len(tail)])
    try:
        usage = json.loads(data or b"").get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def error_event(payload: bytes) -> bytes:
    """Frame an already-encoded JSON error object as an SSE event plus the end-of-stream marker."""
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
