"""Sans-IO helpers for OpenAI-style Server-Sent Events streams.

The relay forwards a pod's SSE bytes untouched; these functions only *look* at them where a
decision needs it: has the first token arrived yet (so response headers can be held until then),
what usage did the stream report at its end, and did it end as a whole answer at all (``[DONE]``,
or a finish reason for every choice; for the Responses API, whose typed events end without
``[DONE]``, a terminal ``response.completed``). Pure functions over bytes, testable alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set
from typing import Any

from transports import json_bytes

DONE = b"[DONE]"
ERROR_EVENT = b'data: {"error"'  # vLLM's in-stream error event (../shared/wire/vllm-midstream-error.txt)
USAGE_MARK = b'"choices":[],"usage":'  # vLLM's (and podsim's) compact usage chunk (include_usage)


class MalformedEvent(ValueError):
    """An SSE ``data:`` payload that is neither ``[DONE]`` nor a JSON object."""


_BLANK_LINE = re.compile(rb"\r\n\r\n|\n\r\n|\r\r\n|\n\n|\r\r")  # the same ends as EVENT_ENDS


def _event_end(buf: bytes, start: int, lf_only: bool = False) -> tuple[int, int]:
    """Offset of the blank line ending the event at ``start`` and its length, or (-1, 0).

    One search for either ending: two ``find`` calls would each scan to the end of the buffer when
    only the other ending occurs, which made a scan over many small events quadratic. ``lf_only``:
    the caller saw no CR from ``start`` on, so the end is the first LF LF, found with one ``find``
    (the regular expression tests each byte against its first characters: ~40 k instructions a
    request for the events before the first token)."""
    if lf_only:
        end = buf.find(b"\n\n", start)
        return (end, 2) if end != -1 else (-1, 0)
    match = _BLANK_LINE.search(buf, start)
    return (match.start(), match.end() - match.start()) if match else (-1, 0)


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
    choices = payload.get("choices")
    if choices is None and "type" in payload:
        return _responses_token(payload)
    for choice in choices if isinstance(choices, list) else ():
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


# -- the Responses API (``/v1/responses``): typed events, ``event: NAME`` lines, no ``[DONE]`` ----------

# The events after which a Responses stream says no more: the answer (or its failure) is whole.
RESPONSES_TERMINAL = (b"response.completed", b"response.failed", b"response.incomplete")
_TERMINAL_TYPES = frozenset(name.decode() for name in RESPONSES_TERMINAL)


def _responses_token(payload: dict[str, Any]) -> bool:
    """A Responses event a client would see: any non-empty ``*.delta`` (text, reasoning, tool
    arguments), an error, or the end. ``response.created``/``in_progress`` and the empty item and
    part openers before the first delta do not count, like chat's role-only chunk."""
    kind = payload.get("type")
    if not isinstance(kind, str):
        return False
    if kind.endswith(".delta"):
        return bool(payload.get("delta"))
    return kind in _TERMINAL_TYPES or kind == "error"


def scan_first_token(buf: bytes, start: int = 0) -> tuple[bool, int]:
    """Look through the complete events in ``buf[start:]`` for the first one that matters.

    An event matters when the client would see something in it: content text, a tool call, a
    finish reason, an error, or the end of the stream. Role-only deltas (vLLM's opening chunk)
    and keep-alive comments do not. Returns ``(found, resume_at)``: where to continue scanning
    when more bytes arrive. Raises ``MalformedEvent`` for a payload that is not JSON.
    """
    pos = start
    lf_only = buf.find(b"\r", start) == -1  # one look for the whole scan (a vLLM stream has no CR)
    while True:
        end, sep = _event_end(buf, pos, lf_only)
        if end == -1:
            return False, pos
        data = event_data(buf[pos:end])
        pos = end + sep
        if data is None:
            continue
        if data.strip() == DONE:
            return True, pos
        try:
            payload = json_bytes.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested past the decoder's depth
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
    end, _ = _event_end(tail, begin, tail.find(b"\r", begin) == -1)
    data = event_data(tail[begin : end if end != -1 else len(tail)])
    try:
        payload = json_bytes.loads(data or b"")
        usage = payload.get("usage")
    except (ValueError, AttributeError, RecursionError):
        return None
    if usage is None and isinstance(payload.get("response"), dict):  # a Responses API final event
        return responses_usage(payload["response"].get("usage"))
    return usage if isinstance(usage, dict) else None


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses API ``usage`` (input/output tokens) in chat's terms (prompt/completion tokens)."""
    if not isinstance(usage, dict):
        return None
    return {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "total_tokens": usage.get("total_tokens"),
    }


def error_event(payload: bytes) -> bytes:
    """Frame an already-encoded JSON error object as an SSE event plus the end-of-stream marker."""
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


# -- end of stream: was the answer whole? ------------------------------------------------------------

# A blank line ends an event; a line ends with CRLF, LF or CR, in any mix (the SSE spec).
EVENT_ENDS = (b"\n\n", b"\n\r\n", b"\r\r\n", b"\r\r")
FINISH_MARKS = (b'"finish_reason":"', b'"finish_reason": "')  # compact (vLLM) and spaced JSON


def ends_event(buf: bytes) -> bool:
    """Whether ``buf`` stops on an event boundary (a blank line), not inside an event."""
    return buf.endswith(EVENT_ENDS)


def _events(buf: bytes) -> list[bytes]:
    if buf.find(b"\r") != -1:
        buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return buf.split(b"\n\n")


def finished_choices(buf: bytes) -> set[int]:
    """The choice indices that a complete event in ``buf`` gives a ``finish_reason``."""
    done: set[int] = set()
    for event in _events(buf):
        data = event_data(event)
        if not data or data.find(b"finish_reason") == -1:
            continue
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):
            continue
        if isinstance(payload, dict):
            done.update(_finished(payload))
    return done


def _finished(payload: dict[str, Any]) -> list[int]:
    out = []
    choices = payload.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("finish_reason") is not None:
            index = choice.get("index", 0)
            out.append(index if isinstance(index, int) else 0)
    return out


def stream_incomplete(
    tail: bytes, choices: int = 1, finished: Set[int] = frozenset()
) -> str | None:
    """Why a stream whose last bytes were ``tail`` did not end as a whole answer; None if it did.

    Whole means: the last event is ``data: [DONE]``; or (a server that omits the marker) the
    stream stops on an event boundary, its last data event is a JSON object, and every choice
    ``0..choices-1`` got a ``finish_reason`` (in the tail, or in ``finished`` seen earlier).
    Called once per stream on the last two reads, never per token.
    """
    if not tail:
        return "the stream ended with no bytes"
    if not ends_event(tail):
        return "the stream ended inside an event"
    events = [e for e in _events(tail) if e.strip()]
    last = event_data(events[-1]) if events else None
    if last is not None and last.strip() == DONE:
        return None
    done = set(finished)
    last_ok = False
    for event in events:
        data = event_data(event)
        if data is None and all(line.startswith(b":") for line in event.split(b"\n") if line):
            continue  # a comment (keep-alive)
        last_ok = False
        if data is None:
            continue  # no data field: not SSE an SDK could use (an HTML error page, say)
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):
            continue
        if not isinstance(payload, dict) or "error" in payload:
            continue
        last_ok = True
        done.update(_finished(payload))
    if not last_ok:
        return "the stream ended on an event that is not a chunk of the answer"
    missing: list[int] = []  # the first 8 at most: n is the client's (a loop, not islice over a generator
    for i in range(choices):  # expression, which mypyc's build makes a whole list first)
        if i not in done:
            missing.append(i)
            if len(missing) == 8:
                break
    if missing:
        which = "its choice" if choices == 1 else f"choice(s) {', '.join(map(str, missing))}"
        return f"the stream ended without data: [DONE] and without a finish_reason for {which}"
    return None


def responses_incomplete(tail: bytes) -> str | None:
    """Why a Responses API stream whose last bytes were ``tail`` was not whole; None if it was.

    Whole means its last event is a terminal one (``response.completed``, ``response.failed`` or
    ``response.incomplete``: each says the answer ended, the last two with the reason), or
    ``data: [DONE]``. The terminal event carries the whole response object, so it may be larger
    than the tail kept: then its data's last field, ``"type":"response.completed"}``, still names it.
    Called once per stream, never per token.
    """
    if not tail:
        return "the stream ended with no bytes"
    if not ends_event(tail):
        return "the stream ended inside an event"
    for event in reversed(_events(tail)):
        lines = [line for line in event.split(b"\n") if line]
        if not lines or all(line.startswith(b":") for line in lines):
            continue  # blank, or a comment (keep-alive)
        for line in lines:
            if line.startswith(b"event:") and line[6:].strip() in RESPONSES_TERMINAL:
                return None
        data = event_data(event)
        if data is not None and data.strip() == DONE:
            return None
        end = event.rstrip()
        if any(end.endswith(b'"type":"%s"}' % name) or end.endswith(b'"type": "%s"}' % name)
               for name in RESPONSES_TERMINAL):
            return None
        break
    return "the stream ended without a response.completed event"
