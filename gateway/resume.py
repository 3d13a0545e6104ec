"""Mid-stream resume: continue a broken stream on another pod as if nothing had happened.

Sans-IO pieces: read what the client has already been sent (``Transcript``), build the
continuation request vLLM understands (the text so far as a final assistant message with
``continue_final_message``, or appended to a completion prompt), and splice the continuation's
events into the same client stream (``Splicer``: same id and created, one role delta, usage that
covers the whole answer). Only resumed streams pay for any of this.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from gateway.admit import encode_body
from transports import sse


def unsupported_reason(route: str, payload: dict[str, Any]) -> str | None:
    """Why this request's stream could not be continued correctly, or None if it can."""
    if (payload.get("n") or 1) != 1:
        return "n > 1"
    if route == "chat" and (payload.get("tools") or payload.get("functions")):
        return "tool calls"
    if payload.get("logprobs") or payload.get("top_logprobs"):
        return "logprobs"
    if route == "completions" and (payload.get("echo") or not isinstance(payload.get("prompt"), str)):
        return "echo or a non-text prompt"
    return None


@dataclass
class Transcript:
    """What the client has received so far, read back from the relayed SSE bytes."""

    text: str = ""
    tokens: int = 0
    finished: bool = False
    id: str | None = None
    created: int | None = None

    @classmethod
    def read(cls, relayed: bytes) -> Transcript:
        out = cls()
        pos = 0
        while True:
            end = relayed.find(b"\n\n", pos)
            if end == -1:
                return out
            data = sse.event_data(relayed[pos:end])
            pos = end + 2
            if not data or data.strip() == sse.DONE:
                continue
            try:
                event = json.loads(data)
            except (ValueError, RecursionError):
                continue
            if not isinstance(event, dict):
                continue
            out.id = out.id or event.get("id")
            out.created = out.created or event.get("created")
            choices = event.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if piece and isinstance(piece, str):
                    out.text += piece
                    out.tokens += 1
                if choice.get("finish_reason") is not None:
                    out.finished = True


def continuation_body(route: str, payload: dict[str, Any], done: Transcript) -> bytes:
    """The request that asks a pod for the rest of the answer."""
    body = dict(payload)
    if route == "chat":
        body["messages"] = [*payload["messages"], {"role": "assistant", "content": done.text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = payload["prompt"] + done.text
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(payload.get(key), int):
            body[key] = max(1, payload[key] - done.tokens)
    return encode_body(body)


@dataclass
class Splicer:
    """Rewrites a continuation's events so they read as the original stream's."""

    created: int | None
    new_created: int | None = None
    tokens_before: int = 0
    _skip_role: bool = True

    def head(self, data: bytes) -> bytes:
        """The continuation's opening bytes, without its role-only event(s)."""
        out = []
        pos = 0
        while True:
            end = data.find(b"\n\n", pos)
            if end == -1:
                out.append(data[pos:])
                break
            event = data[pos : end + 2]
            pos = end + 2
            payload = sse.event_data(event)
            if payload and self.new_created is None:
                with contextlib.suppress(ValueError, AttributeError, RecursionError):
                    self.new_created = json.loads(payload).get("created")
            if self._skip_role and payload and b'"role"' in payload and b'"content":""' in payload:
                continue
            self._skip_role = False
            out.append(event)
        return self.chunk(b"".join(out))

    def chunk(self, data: bytes) -> bytes:
        if type(self.created) is int and type(self.new_created) is int and self.new_created != self.created:
            data = data.replace(b'"created":%d' % self.new_created, b'"created":%d' % self.created)
        if b'"usage"' in data:
            data = self._fix_usage(data)
        return data

    def _fix_usage(self, data: bytes) -> bytes:
        """Usage over the whole answer: the text before the break was prompt to this pod."""
        events = data.split(b"\n\n")
        for i, event in enumerate(events):
            if b'"usage"' not in event or not event.startswith(b"data: "):
                continue
            try:
                payload = json.loads(event[6:])
                usage = payload["usage"]
                usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - self.tokens_before)
                usage["completion_tokens"] += self.tokens_before
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
            events[i] = b"data: " + json.dumps(payload, separators=(",", ":")).encode()
        return b"\n\n".join(events)


class Recorder:
    """Passes complete events on (holding back a partial one), remembers them, spots pod errors.

    Used only for streams that may be resumed: a partial event already sent could not be
    continued cleanly, and a pod's own mid-stream error event is a break to resume from, not
    something the client should see.
    """

    __slots__ = ("broken", "sent", "splicer", "tail")

    def __init__(self) -> None:
        self.sent = bytearray()
        self.tail = b""
        self.broken = False
        self.splicer: Splicer | None = None

    def filter(self, body: bytes) -> bytes:
        if self.broken:
            return b""
        data = self.tail + body if self.tail else body
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self.tail = data
            return b""
        self.tail = data[cut:]
        out = data[:cut]
        error_at = out.find(b'data: {"error"')
        if error_at != -1:
            out = out[:error_at]
            self.broken = True
        if self.splicer is not None and out:
            out = self.splicer.chunk(out)
        self.sent += out
        return out
