"""``chat.completion.chunk`` events serialized as ChatCompletionChunk without the generated code.

One chunk per token is the gRPC-Web hot path: the hand-written serialization here costs about a
third of the generated code's, and a plain token event is serialized from its bytes without a
JSON parse at all. Anything unusual falls back to ``gateway.grpc_web_messages.chunk_message``.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.grpc_web_messages import chunk_message
from transports import json_bytes
from transports.grpc_web import encode_message


class ChunkEncoder:
    """``chat.completion.chunk`` events serialized as ChatCompletionChunk, on the hot path.

    ``encode(event)`` writes byte for byte what ``chunk_message(event).SerializeToString()`` writes
    (the tests compare them on every shape of event) at about a third of the cost: fields in number
    order, defaults left out, the stream's id/created/model (the same in every chunk) encoded once.
    Anything unusual (a negative number, a value of the wrong type) goes through the generated code.

    ``token(data)`` serializes a plain token event without parsing it. Each parsed event that
    carries one choice's content and nothing else is learned as a template: the bytes before its
    content string and the bytes after. An event with the same bytes around a content that holds
    no quote, backslash or control character parses, by JSON's grammar, to the same object with
    that content (checked once per template by parsing a probe), so it needs no ``json.loads``.
    vLLM's token events differ only in their content, so after the first one a token costs a
    prefix and a suffix comparison. Any other event falls back to the parse.

    ``token_frame(read)`` goes one step further for the commonest pod read of all, one whole token
    event (``data: {...}\n\n``): the finished message frame, everything but the content taken from
    a cache keyed by the content's length (the only thing the lengths in the frame depend on).
    ``data_frame(data)`` does the same for one event's data, in a read that holds several.
    """

    __slots__ = (
        "_choice_head", "_event_prefix", "_event_suffix", "_frame_heads", "_head", "_key", "_prefix",
        "_suffix", "_tail",
    )  # fmt: skip

    def __init__(self) -> None:
        self._key: tuple[Any, Any, Any] | None = None
        self._head = b""
        self._prefix: bytes | None = None  # the learned template, when there is one
        self._suffix = b""
        self._choice_head = b""
        self._tail = b""
        self._event_prefix: bytes | None = None  # the template as one whole SSE event
        self._event_suffix = b""
        self._frame_heads: dict[int, bytes] = {}  # content length → the frame's bytes before the content

    def token(self, data: bytes) -> bytes | None:
        """The serialized chunk for a token event that fits the learned template, else None."""
        prefix = self._prefix
        text = None if prefix is None else _content(data, prefix, self._suffix)
        return None if text is None else self._token_payload(text)

    def token_frame(self, read: bytes) -> bytes | None:
        """The message frame for a read that is exactly one token event fitting the template, else None."""
        prefix = self._event_prefix
        text = None if prefix is None else _content(read, prefix, self._event_suffix)
        return None if text is None else self._frame(text)  # (no newline in it: one event)

    def data_frame(self, data: bytes) -> bytes | None:
        """The message frame for one event's data, when it is a token event fitting the template."""
        prefix = self._prefix
        text = None if prefix is None else _content(data, prefix, self._suffix)
        return None if text is None else self._frame(text)

    def _frame(self, text: bytes) -> bytes:
        n = len(text)
        head = self._frame_heads.get(n)
        if head is None:
            frame = encode_message(self._token_payload(bytes(n)))
            head = frame[: len(frame) - n - len(self._tail)]
            if n < _CACHED_LENGTHS:
                self._frame_heads[n] = head
        return head + text + self._tail

    def _token_payload(self, text: bytes) -> bytes:
        return (
            self._head
            + _len_field(0x22, self._choice_head + _len_field(0x12, _len_field(0x12, text)))
            + self._tail
        )

    def _forget(self) -> None:
        """No template from here on (until the next one is learned)."""
        self._prefix = self._event_prefix = None
        self._frame_heads = {}

    def encode(self, event: dict[str, Any], data: bytes | None = None) -> bytes:
        """The serialized chunk; with the event's raw ``data``, also learn it as a template."""
        try:
            key = (event.get("id"), event.get("created"), event.get("model"))
            if key != self._key:
                self._head = _str_field(0x0A, key[0]) + _int_field(0x10, key[1]) + _str_field(0x1A, key[2])
                self._key = key
                self._forget()
            parts = [self._head]
            choices = event.get("choices") or ()
            for c in choices:
                parts.append(_len_field(0x22, _choice(c)))
            usage = event.get("usage")
            if usage:
                fields = (
                    usage.get("prompt_tokens"),
                    usage.get("completion_tokens"),
                    usage.get("total_tokens"),
                )
                parts.append(_len_field(0x2A, b"".join(map(_int_field, (0x08, 0x10, 0x18), fields))))
            fingerprint = event.get("system_fingerprint")
            tail = _len_field(0x32, _utf8(fingerprint)) if fingerprint else b""
            parts.append(tail)
            if data is not None and len(choices) == 1 and not usage:
                self._learn(event, data, tail)
            return b"".join(parts)
        except _Unusual:
            self._key = None
            self._forget()
            return chunk_message(event).SerializeToString()

    def _learn(self, event: dict[str, Any], data: bytes, tail: bytes) -> None:
        choice = event["choices"][0]
        delta = choice.get("delta") if type(choice) is dict else None
        if type(delta) is not dict or choice.get("finish_reason") is not None:
            return
        content = delta.get("content")
        if any(value is not None for key, value in delta.items() if key != "content"):
            return
        at = data.find(_CONTENT)
        if type(content) is not str or at == -1:
            return
        start = at + len(_CONTENT)
        end = data.find(b'"', start)
        if end == -1 or data[start:end] != content.encode() or _SPECIAL.search(data, start, end) is not None:
            return
        prefix, suffix = data[:start], data[end:]
        try:  # the template must put any content there and change nothing else
            probe = parse_json(prefix + b"probe" + suffix)
            landed = probe["choices"][0]["delta"]
            if landed["content"] != "probe":
                return
            landed["content"] = content
        except (ValueError, TypeError, KeyError, IndexError):
            return
        if probe != event:
            return
        self._forget()
        self._prefix, self._suffix, self._tail = prefix, suffix, tail
        self._choice_head = _int_field(0x08, choice.get("index"))
        if data.find(b"\n") == -1 and data.find(b"\r") == -1:  # else not one ``data:`` line as it stands
            self._event_prefix, self._event_suffix = b"data: " + prefix, suffix + b"\n\n"


_CONTENT = b'"content":"'
_CACHED_LENGTHS = 256  # frame heads kept for contents shorter than this (a token is a few bytes)
_SPECIAL = re.compile(rb'["\\\x00-\x1f]')


def _content(data: bytes, prefix: bytes, suffix: bytes) -> bytes | None:
    """The bytes between ``prefix`` and ``suffix`` when ``data`` is just those three and they are a
    JSON string's content that needs no unescaping (no quote, backslash or control character) in
    valid UTF-8; else None."""
    if not data.startswith(prefix) or not data.endswith(suffix):
        return None
    end = len(data) - len(suffix)
    if len(prefix) > end:  # prefix and suffix overlap
        return None
    text = data[len(prefix) : end]
    if _SPECIAL.search(text) is not None:
        return None
    if not text.isascii():
        try:
            text.decode()
        except UnicodeDecodeError:
            return None
    return text


class _Unusual(Exception):
    """A value the fast encoder leaves to the generated code."""


def _choice(c: dict[str, Any]) -> bytes:
    out = _int_field(0x08, c.get("index"))
    delta = c.get("delta")
    if delta:
        role, content = delta.get("role"), delta.get("content")
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        body = b""
        if role is not None:
            body += _len_field(0x0A, _utf8(role))
        if content is not None:
            body += _len_field(0x12, _utf8(content))
        if reasoning is not None:
            body += _len_field(0x1A, _utf8(reasoning))
        if body:  # as the generated code: a delta with none of these (tool calls only) is not written
            out += _len_field(0x12, body)
    finish = c.get("finish_reason")
    if finish is not None:
        out += _len_field(0x1A, _utf8(finish))
    return out


def _utf8(value: Any) -> bytes:
    if type(value) is not str:
        raise _Unusual
    return value.encode()


def _str_field(tag: int, value: Any) -> bytes:
    """An implicit-presence string field: nothing when empty or absent."""
    return _len_field(tag, _utf8(value)) if value else b""


def _int_field(tag: int, value: Any) -> bytes:
    """An implicit-presence unsigned field: nothing when zero or absent."""
    if not value:
        return b""
    if type(value) is not int or value < 0 or value >= 1 << 32:
        raise _Unusual  # uint32 fields overflow, and int64 ones need more than this checks
    return bytes((tag,)) + _varint(value)


def _len_field(tag: int, data: bytes) -> bytes:
    n = len(data)
    return (bytes((tag, n)) if n < 0x80 else bytes((tag,)) + _varint(n)) + data


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def parse_json(data: bytes) -> Any:
    """``json.loads`` for one SSE payload (``transports.json_bytes``).

    Raises ValueError, also for JSON nested past the decoder's depth (a RecursionError there)."""
    try:
        return json_bytes.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
