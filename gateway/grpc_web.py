"""gRPC-Web in front of the relay: ``sluicegate.v1.Inference`` (see proto/ and docs/grpc-web.md).

A transport adapter, not a second request path. Each call becomes the OpenAI JSON body an HTTP
client would have sent to ``/v1/chat/completions``, and runs through the same ``Relay.__call__``
(admission, limits, tiers, timeouts, routing, retries, resume, shedding, metrics, access log).
The adapter owns only what differs on the wire:

- in: a synthetic ``receive`` that reads the gRPC-Web body, deframes and decodes the protobuf
  request and hands the relay its JSON; after that it passes the real ``receive`` through, so the
  relay's disconnect watch still sees the client leave. A body that is not a valid request raises
  the gateway's own 400/413 from inside the relay's admission, so it is answered and counted there.
- out: a ``send`` wrapper that turns the relay's ASGI messages into gRPC-Web. A JSON error with its
  HTTP status becomes a Trailers-Only answer (``grpc-status`` in the headers, HTTP 200); an SSE
  stream becomes one ChatCompletionChunk frame per event and a trailers frame at its end (an SSE
  error event sets the trailers' status); a whole JSON answer becomes one message frame.
- the client's ``grpc-timeout`` becomes ``X-Request-Timeout-Ms``, which the relay already honours as
  a cap on the request's total deadline (never longer than the tier allows).

The relay's HTTP/1.1 splice (pod bytes written straight to the client socket) finds the socket
through ``send.__self__``; the wrapper's ``send`` is a method of the per-call adapter, which has no
transport, so every body goes through the wrapper. The synthetic ``receive`` is instead bound to
the server's request cycle (``receive.__self__``) when there is one, so the relay's tripwire and
hang-up watcher install on the real connection exactly as for an HTTP client.

Per event: a vLLM token event that differs from the stream's previous one only in its content is
serialized from its bytes without a JSON parse (``ChunkEncoder.token``); any other event costs one
``json.loads`` and a hand-written serialization that the tests hold to the generated code's bytes.
One pod read is one ASGI send, however many events it holds.
"""

from __future__ import annotations

import json
import logging
import math
import re
import types
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from gateway.deadlines import CLIENT_TIMEOUT_HEADER
from gateway.errors import GatewayError, bad_request
from gateway.proto.sluicegate.v1 import inference_pb2 as pb
from gateway.relay import Receive, Relay, Scope, Send
from transports import grpc_web as codec
from transports.grpc_web import Status
from transports.sse import event_data, stream_incomplete

log = logging.getLogger("sluicegate.grpc_web")

SERVICE = "sluicegate.v1.Inference"
PREFIX = f"/{SERVICE}/"
METHODS = {"StreamChatCompletion": True, "ChatCompletion": False}  # method → server streaming?

ALLOW_HEADERS = ("content-type", "x-grpc-web", "x-user-agent", "grpc-timeout", "authorization",
                 "x-request-id", "x-request-timeout-ms")  # fmt: skip
EXPOSE_HEADERS = (
    b"grpc-status,grpc-message,grpc-status-details-bin,x-request-id,x-sluicegate-pod,retry-after,"
    b"x-sluicegate-degraded"
)
PREFLIGHT_MAX_AGE_S = b"7200"  # Chromium's cap; Firefox allows a day

# Request headers that describe the gRPC-Web envelope, not the call: not handed to the relay
# (which forwards the client's end-to-end headers to the pod).
_ENVELOPE = frozenset(
    {
        b"content-type",
        b"content-length",
        b"grpc-timeout",
        b"grpc-encoding",
        b"grpc-accept-encoding",
        b"x-grpc-web",
        b"x-user-agent",
        b"te",
        b"accept",
        b"origin",
        CLIENT_TIMEOUT_HEADER,
    }
)
_PASSED_BACK = (b"x-request-id", b"x-sluicegate-pod", b"retry-after", b"x-sluicegate-degraded", b"alt-svc")
TRANSPORT_LABEL = "grpc-web"  # the relay's metrics and access log name the client's transport


class GrpcWebEndpoint:
    """The ASGI handler for ``/sluicegate.v1.Inference/*`` (POST calls and OPTIONS preflights).

    ``allowed_origins``: the browser origins whose pages may call the API (CORS); None allows any
    origin. Credentials (cookies) are never allowed; ``Authorization`` is an ordinary header.
    """

    def __init__(self, relay: Relay, allowed_origins: Collection[str] | None = None) -> None:
        self.relay = relay
        self.allowed_origins = None if allowed_origins is None else {o.encode() for o in allowed_origins}
        config = relay.config
        self.allow_headers = [*ALLOW_HEADERS, config.tier_header, config.shedding.criticality_header]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        origin = _header(headers, b"origin")
        cors = self._cors(origin)
        if scope["method"] == "OPTIONS":
            await self._preflight(headers, origin, cors, send)
            return
        stream = METHODS.get(scope["path"][len(PREFIX) :])
        if stream is None:
            message = f"Method {scope['path']} is not implemented here."
            await _answer(send, 200, Status.UNIMPLEMENTED, message, cors)
            return
        if scope["method"] != "POST":
            message = f"HTTP method {scope['method']} is not allowed; gRPC-Web calls are POSTs."
            await _answer(send, 405, Status.UNIMPLEMENTED, message, cors, ((b"allow", b"POST, OPTIONS"),))
            return
        text = codec.text_mode(_header(headers, b"content-type") or b"")
        if text is None:
            message = (
                "Unsupported content type; use application/grpc-web[+proto] or application/grpc-web-text."
            )
            await _answer(send, 415, Status.INVALID_ARGUMENT, message, cors)
            return
        try:
            relay_headers = _relay_headers(headers)
        except codec.ProtocolError as exc:
            await _answer(send, 200, Status.INVALID_ARGUMENT, str(exc), cors)
            return
        call = Call(stream, text, cors, receive, send, self.relay.config.server.max_body_bytes)
        scope = {**scope, "headers": relay_headers, "sluicegate.transport": TRANSPORT_LABEL}
        await self.relay(scope, call.receive, call.send, "chat")

    def _cors(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        if origin is None or (self.allowed_origins is not None and origin not in self.allowed_origins):
            return []
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-expose-headers", EXPOSE_HEADERS),
            (b"vary", b"Origin"),
        ]

    async def _preflight(
        self,
        headers: list[tuple[bytes, bytes]],
        origin: bytes | None,
        cors: list[tuple[bytes, bytes]],
        send: Send,
    ) -> None:
        out = [(b"allow", b"POST, OPTIONS"), (b"content-length", b"0")]
        status = 204
        if cors:
            allowed = list(self.allow_headers)
            asked = _header(headers, b"access-control-request-headers")
            if asked:  # any header the page asks for: no credentials are ever allowed, so none is risky
                for name in asked.decode("latin-1").lower().split(","):
                    if name.strip() and name.strip() not in allowed:
                        allowed.append(name.strip())
            out += [
                (b"access-control-allow-origin", cors[0][1]),
                (b"access-control-allow-methods", b"POST, OPTIONS"),
                (b"access-control-allow-headers", ",".join(allowed).encode("latin-1")),
                (b"access-control-max-age", PREFLIGHT_MAX_AGE_S),
                (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
            ]
        elif origin is not None:
            status = 403  # an origin that is not allowed: no CORS headers, so the browser refuses
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": b""})


class Call:
    """One gRPC-Web call's adapter between the client's ASGI connection and the relay."""

    __slots__ = (
        "_body",
        "_choices",
        "_chunks",
        "_client_receive",
        "_client_send",
        "_cors",
        "_ended",
        "_failed",
        "_finished",
        "_http_status",
        "_last",
        "_limit",
        "_message",
        "_mode",
        "_passed_back",
        "_previous",
        "_rest",
        "_status",
        "_stream",
        "_text",
        "receive",
    )

    def __init__(
        self,
        stream: bool,
        text: bool,
        cors: list[tuple[bytes, bytes]],
        receive: Receive,
        send: Send,
        limit: int,
    ) -> None:
        self._stream = stream
        self._text = text
        self._cors = cors
        self._client_receive = receive
        self._client_send = send
        self._limit = limit
        self._mode = _PENDING
        self._body: list[bytes] = []
        self._rest = b""
        self._chunks = ChunkEncoder()
        self._status = Status.OK
        self._message = ""
        self._failed = False
        self._ended = False  # the stream's ``data: [DONE]`` went by
        self._choices = 1  # the request's n: each choice must finish (when no [DONE] comes)
        self._finished: set[int] = set()  # choices seen with a finish_reason
        self._previous = self._last = b""  # the relay's last two body messages, for the end's verdict
        self._http_status = 0
        self._passed_back: list[tuple[bytes, bytes]] = []
        # Bound to the server's request cycle when there is one, so the relay's disconnect watch
        # (which looks through ``receive.__self__``) watches the real connection.
        owner = getattr(receive, "__self__", None)
        self.receive: Receive = types.MethodType(self._replay, owner) if owner is not None else self._replay

    # -- in --------------------------------------------------------------------------------------

    def _replay(self, _owner: Any = None) -> Awaitable[dict[str, Any]]:
        if self._mode is _PENDING:
            self._mode = _READ
            return self._read_request()
        return self._client_receive()

    async def _read_request(self) -> dict[str, Any]:
        """The client's whole gRPC-Web body, decoded into the relay's JSON request body."""
        limit = self._limit
        raw: list[bytes] = []
        size = 0
        while True:
            message = await self._client_receive()
            if message["type"] == "http.disconnect":
                return message  # the relay's admission sees the client gone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > (limit * 4 // 3 + 12 if self._text else limit + 5):  # base64; the frame header
                    raise _too_large(limit)
                raw.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(raw)
        try:
            if self._text:
                body = codec.decode_text(body)
            frames = codec.decode_frames(body, limit)
        except codec.FrameTooLarge:
            raise _too_large(limit) from None
        except codec.ProtocolError as exc:
            raise bad_request(f"Malformed gRPC-Web request body: {exc}.", code="invalid_grpc_web") from None
        if len(frames) != 1 or frames[0].is_trailers:
            raise bad_request(
                f"A unary request body must hold exactly one message frame, not {len(frames)} frames.",
                code="invalid_grpc_web",
            )
        if frames[0].is_compressed:
            raise GatewayError(
                501, "Compressed gRPC messages are not supported; send them with grpc-encoding identity.",
                "invalid_request_error", "grpc_compression_unsupported",
            )  # fmt: skip
        try:
            request = pb.ChatCompletionRequest.FromString(frames[0].payload)
        except Exception as exc:  # protobuf's DecodeError, whatever the backend
            raise bad_request(
                f"The request is not a valid ChatCompletionRequest: {exc}.", code="invalid_protobuf"
            ) from None
        if request.HasField("n") and request.n > 1:
            self._choices = request.n
        return {"type": "http.request", "body": openai_body(request, self._stream), "more_body": False}

    # -- out -------------------------------------------------------------------------------------

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            mode = self._mode
            if mode is _STREAM:
                body = message.get("body", b"")
                if body:
                    self._previous, self._last = self._last, body
                out = self._frames(body)
                more = message.get("more_body", False)
                if not more:
                    self._judge_end()
                    out += codec.encode_trailers(self._status, self._message)
                if out or not more:
                    await self._client_send(
                        {"type": "http.response.body", "body": codec.encode_text(out) if self._text else out,
                         "more_body": more}
                    )  # fmt: skip
                return
            self._body.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = b"".join(self._body)
                if mode is _WHOLE:
                    await self._send_whole(body)
                else:
                    await self._send_error(body)
            return
        if message["type"] == "http.response.start":
            await self._start(message)

    async def _start(self, message: dict[str, Any]) -> None:
        status = message["status"]
        headers = message.get("headers", ())
        self._passed_back = [(n, v) for n, v in headers if n in _PASSED_BACK]
        content_type = _header(headers, b"content-type") or b""
        if status != 200:
            self._mode = _ERROR
            self._http_status = status
            return
        if not content_type.startswith(b"text/event-stream"):
            self._mode = _WHOLE
            return
        self._mode = _STREAM
        await self._client_send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": self._response_headers(),
            }
        )

    def _response_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", codec.response_content_type(self._text)), *self._passed_back, *self._cors]

    def _frames(self, body: bytes) -> bytes:
        """The message frames for the complete SSE events in what the relay has sent so far."""
        buf = self._rest + body if self._rest else body
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._rest = events.pop()
        if not events or self._failed:
            return b""
        out = []
        token, encode = self._chunks.token, self._chunks.encode
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                data: bytes | None = event[6:]
            else:
                data = event_data(event)
            if data is None:
                continue
            if data == b"[DONE]":
                self._ended = True
                continue
            payload = token(data)
            if payload is None:
                try:
                    chunk = parse_json(data)
                    if "error" in chunk:
                        self._fail(chunk["error"])
                        break
                    for choice in chunk.get("choices") or ():  # (template tokens never finish)
                        if choice.get("finish_reason") is not None:
                            self._finished.add(choice.get("index") or 0)
                    payload = encode(chunk, data)
                except (ValueError, TypeError, AttributeError, KeyError):
                    # A malformed event carries nothing a client could use: skip it, as SSE clients do.
                    log.debug("skipping a malformed event: %.200r", data)
                    continue
            out.append(codec.encode_message(payload))
        return b"".join(out)

    def _judge_end(self) -> None:
        """A stream that ends without being whole was cut short: never an OK.

        The relay already turns a pod's short stream into an error event; this holds the same rule
        (``transports.sse.stream_incomplete``) for anything else that ends the relay's SSE early.
        """
        if self._failed or (self._ended and not self._rest.strip()):
            return
        why = (
            "bytes after data: [DONE]"
            if self._ended
            else stream_incomplete(self._previous + self._last, self._choices, self._finished)
        )
        if why is None:
            return
        self._failed = True
        self._status = Status.UNAVAILABLE
        self._message = f"The answer stream ended before it was complete: {why}."

    def _fail(self, error: Any) -> None:
        """An SSE error event ended the stream: its status goes into the trailers."""
        self._failed = True
        if isinstance(error, dict):
            self._status = codec.status_for_error(None, error.get("type"), error.get("code"))
            self._message = str(error.get("message") or "")
        else:
            self._status, self._message = Status.INTERNAL, str(error)

    async def _send_whole(self, body: bytes) -> None:
        try:
            answer = json.loads(body)
            if self._stream:  # the pod answered a streaming request with a whole body: one chunk
                payload = chunk_message(_as_chunk(answer)).SerializeToString()
            else:
                payload = completion_message(answer).SerializeToString()
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            await _answer(
                self._client_send, 200, Status.INTERNAL, f"The pod's answer could not be translated: {exc}",
                self._cors, self._passed_back, self._text,
            )  # fmt: skip
            return
        out = codec.encode_message(payload) + codec.encode_trailers(Status.OK)
        if self._text:
            out = codec.encode_text(out)
        headers = self._response_headers()
        headers.append((b"content-length", b"%d" % len(out)))
        await self._client_send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._client_send({"type": "http.response.body", "body": out})

    async def _send_error(self, body: bytes) -> None:
        http_status: int = self._http_status
        error_type = error_code = None
        message = ""
        try:
            error = json.loads(body)["error"]
            message, error_type, error_code = (
                str(error.get("message") or ""),
                error.get("type"),
                error.get("code"),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            message = body[:500].decode("utf-8", "replace")
        status = codec.status_for_error(http_status, error_type, error_code)
        await _answer(
            self._client_send, 200, status, message or f"HTTP {http_status}", self._cors, self._passed_back,
            self._text,
        )  # fmt: skip


# Modes of a call's response, as the relay's messages reveal it.
_PENDING = "pending"  # the request body is still to be read
_READ = "read"  # the relay has the request; nothing answered yet
_STREAM = "stream"  # SSE events → message frames
_WHOLE = "whole"  # a whole JSON answer → one message frame
_ERROR = "error"  # a JSON error → Trailers-Only


# -- translation: protobuf ↔ OpenAI JSON ----------------------------------------------------------

_OPTIONAL_FIELDS = (
    "max_tokens", "temperature", "top_p", "user", "seed", "n", "presence_penalty", "frequency_penalty",
    "max_completion_tokens", "top_k", "min_p", "ignore_eos",
)  # fmt: skip


def openai_body(request: pb.ChatCompletionRequest, stream: bool) -> bytes:
    """The OpenAI ``/v1/chat/completions`` JSON body for a ChatCompletionRequest."""
    messages = []
    for m in request.messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            item["name"] = m.name
        messages.append(item)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    for name in _OPTIONAL_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if stream:
        body["stream"] = True
        if request.stream_options.include_usage:
            body["stream_options"] = {"include_usage": True}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def chunk_message(event: dict[str, Any]) -> pb.ChatCompletionChunk:
    """A ``chat.completion.chunk`` event as a ChatCompletionChunk."""
    return _completion(pb.ChatCompletionChunk, event, "delta", _fill_delta)


def completion_message(answer: dict[str, Any]) -> pb.ChatCompletion:
    """A ``chat.completion`` body as a ChatCompletion."""
    return _completion(pb.ChatCompletion, answer, "message", _fill_message)


def _completion(
    cls: Any, body: dict[str, Any], part: str, fill: Callable[[Any, dict[str, Any]], None]
) -> Any:
    """What a chunk and a whole completion share: the top-level fields, and each choice's index and
    finish reason; ``fill`` copies the choice's ``part`` (its delta or its message)."""
    msg = cls(id=body.get("id") or "", created=body.get("created") or 0, model=body.get("model") or "")
    for c in body.get("choices") or ():
        choice = msg.choices.add(index=c.get("index") or 0)
        value = c.get(part)
        if value:
            fill(getattr(choice, part), value)
        finish = c.get("finish_reason")
        if finish is not None:
            choice.finish_reason = finish
    usage = body.get("usage")
    if usage:
        _usage(msg.usage, usage)
    fingerprint = body.get("system_fingerprint")
    if fingerprint:
        msg.system_fingerprint = fingerprint
    return msg


def _fill_delta(out: pb.Delta, delta: dict[str, Any]) -> None:
    role = delta.get("role")
    if role is not None:
        out.role = role
    content = delta.get("content")
    if content is not None:
        out.content = content
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if reasoning is not None:
        out.reasoning_content = reasoning


def _fill_message(out: pb.ChatMessage, message: dict[str, Any]) -> None:
    out.role = message.get("role") or ""
    out.content = message.get("content") or ""
    if message.get("name"):
        out.name = message["name"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None:
        out.reasoning_content = reasoning


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
    """

    __slots__ = ("_choice_head", "_head", "_key", "_prefix", "_suffix", "_tail")

    def __init__(self) -> None:
        self._key: tuple[Any, Any, Any] | None = None
        self._head = b""
        self._prefix: bytes | None = None  # the learned template, when there is one
        self._suffix = b""
        self._choice_head = b""
        self._tail = b""

    def token(self, data: bytes) -> bytes | None:
        """The serialized chunk for a token event that fits the learned template, else None."""
        prefix, suffix = self._prefix, self._suffix
        if prefix is None or not data.startswith(prefix) or not data.endswith(suffix):
            return None
        text = data[len(prefix) : len(data) - len(suffix)]
        if len(text) + len(prefix) + len(suffix) != len(data) or _SPECIAL.search(text) is not None:
            return None
        if not text.isascii():
            try:
                text.decode()
            except UnicodeDecodeError:
                return None
        return (
            self._head
            + _len_field(0x22, self._choice_head + _len_field(0x12, _len_field(0x12, text)))
            + self._tail
        )

    def encode(self, event: dict[str, Any], data: bytes | None = None) -> bytes:
        """The serialized chunk; with the event's raw ``data``, also learn it as a template."""
        try:
            key = (event.get("id"), event.get("created"), event.get("model"))
            if key != self._key:
                self._head = _str_field(0x0A, key[0]) + _int_field(0x10, key[1]) + _str_field(0x1A, key[2])
                self._key = key
                self._prefix = None
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
            self._key = self._prefix = None
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
        self._prefix, self._suffix, self._tail = prefix, suffix, tail
        self._choice_head = _int_field(0x08, choice.get("index"))


_CONTENT = b'"content":"'
_SPECIAL = re.compile(rb'["\\\x00-\x1f]')


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


_scan = json.JSONDecoder().scan_once


def parse_json(data: bytes) -> Any:
    """``json.loads`` for one SSE payload, without its per-call encoding detection and regexes."""
    text = data.decode()
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        end = -1  # e.g. leading whitespace: json.loads decides
    return value if end == len(text) else json.loads(text)


def _usage(out: pb.Usage, usage: dict[str, Any]) -> None:
    out.prompt_tokens = usage.get("prompt_tokens") or 0
    out.completion_tokens = usage.get("completion_tokens") or 0
    out.total_tokens = usage.get("total_tokens") or 0


def _as_chunk(answer: dict[str, Any]) -> dict[str, Any]:
    """A whole ``chat.completion`` as the single chunk of a stream."""
    choices = [
        {"index": c.get("index"), "delta": c.get("message"), "finish_reason": c.get("finish_reason")}
        for c in answer.get("choices") or ()
    ]
    return {**answer, "choices": choices}


# -- helpers ---------------------------------------------------------------------------------------


def _too_large(limit: int) -> GatewayError:
    """The relay's own 413 (RESOURCE_EXHAUSTED, as gRPC servers answer an oversized message)."""
    return GatewayError(
        413, f"Request message is larger than the gateway's limit of {limit} bytes.",
        "invalid_request_error", "request_too_large",
    )  # fmt: skip


def _header(headers: Collection[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _relay_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers as the relay should see them: the envelope's left out, the body labelled
    JSON, and ``grpc-timeout`` as the relay's ``X-Request-Timeout-Ms`` (the shorter, with the
    client's own)."""
    out = [(n, v) for n, v in headers if n not in _ENVELOPE]
    out.append((b"content-type", b"application/json"))
    deadline_ms: int | None = None
    grpc_timeout = _header(headers, b"grpc-timeout")
    if grpc_timeout is not None:
        deadline_ms = max(1, math.ceil(codec.parse_timeout(grpc_timeout) * 1000))
    asked = _header(headers, CLIENT_TIMEOUT_HEADER)
    if asked is not None:
        if not asked.strip().isdigit() or deadline_ms is None:
            out.append((CLIENT_TIMEOUT_HEADER, asked))  # the relay judges it (a 400 when it is not a number)
            return out
        deadline_ms = min(deadline_ms, int(asked))
    if deadline_ms is not None:
        out.append((CLIENT_TIMEOUT_HEADER, b"%d" % deadline_ms))
    return out


async def _answer(
    send: Callable[[dict[str, Any]], Awaitable[None]],
    http_status: int,
    status: Status,
    message: str,
    cors: list[tuple[bytes, bytes]],
    extra: Collection[tuple[bytes, bytes]] = (),
    text: bool = False,
) -> None:
    """A Trailers-Only answer: the status in the headers, no body."""
    headers = [
        (b"content-type", codec.response_content_type(text)),
        *codec.trailers_only_headers(status, message),
        *extra,
        *cors,
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": http_status, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
