"""One gRPC-Web call, adapted to the relay: a synthetic ``receive`` in, a re-encoding ``send`` out.

- in: ``receive`` reads the gRPC-Web body, deframes and decodes the protobuf request and hands the
  relay its JSON; after that it passes the real ``receive`` through, so the relay's disconnect
  watch still sees the client leave. A body that is not a valid request raises the gateway's own
  400/413 from inside the relay's admission, so it is answered and counted there.
- out: ``send`` turns the relay's ASGI messages into gRPC-Web. A JSON error with its HTTP status
  becomes a Trailers-Only answer (``grpc-status`` in the headers, HTTP 200); an SSE stream becomes
  one ChatCompletionChunk frame per event and a trailers frame at its end (an SSE error event sets
  the trailers' status); a whole JSON answer becomes one message frame.
- splice: once the stream's headers are out, ``splice_target`` gives the relay's splice (see
  ``transports/client_socket.py``) the client's own target behind a translating sink, so the pod's
  reads become frames written from the pod connection's callback, with no ASGI send per read.
  Without a target (a server the splice does not know) one pod read is one ASGI send.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from gateway.errors import GatewayError, bad_request
from gateway.exchange import Receive, Send
from gateway.grpc_web_chunks import ChunkEncoder, parse_json
from gateway.grpc_web_messages import as_chunk, chunk_message, completion_message, openai_body
from transports import grpc_web as codec
from transports.client_socket import Sink, SpliceTarget, Upstream, client_socket
from transports.grpc_web import Status
from transports.proto.sluicegate.v1 import inference_pb2 as pb
from transports.sse import event_data, stream_incomplete

log = logging.getLogger("sluicegate.grpc_web")

# Response headers of the relay's that the client sees too.
_PASSED_BACK = frozenset((
    b"x-request-id", b"x-sluicegate-pod", b"x-sluicegate-variant", b"retry-after", b"x-sluicegate-degraded",
    b"alt-svc",
    # the caller's quota (OpenAI's names), so a gRPC-Web client can pace itself as an SDK does
    b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests",
    b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens",
))


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
                    raise too_large(limit)
                raw.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(raw)
        try:
            if self._text:
                body = codec.decode_text(body)
            frames = codec.decode_frames(body, limit)
        except codec.FrameTooLarge:
            raise too_large(limit) from None
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
                out = self._frames(message.get("body", b""))
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
        content_type = header(headers, b"content-type") or b""
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

    def splice_target(self) -> Splice | None:
        """Where the relay's splice may write a streaming answer: the client's socket, through the
        translation (None before the stream's headers, or when the connection has no socket to splice to)."""
        if self._mode is not _STREAM:
            return None
        socket = client_socket(self._client_send)
        return None if socket is None else Splice(self, socket)

    def _frames(self, body: bytes) -> bytes:
        """The message frames for the complete SSE events in what the relay has sent so far."""
        if body:
            self._previous, self._last = self._last, body
            if not self._rest and not self._failed:  # the commonest read: one whole token event
                frame = self._chunks.token_frame(body)
                if frame is not None:
                    return frame
        buf = self._rest + body if self._rest else body
        if buf.find(b"\r") != -1:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._rest = events.pop()
        if not events or self._failed:
            return b""
        out = []
        data_frame, encode = self._chunks.data_frame, self._chunks.encode
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
            frame = data_frame(data)
            if frame is not None:
                out.append(frame)
                continue
            try:
                chunk = parse_json(data)
                if "error" in chunk:
                    self._fail(chunk["error"])
                    break
                for choice in chunk.get("choices") or ():  # (template tokens never finish)
                    if choice.get("finish_reason") is not None:
                        self._finished.add(choice.get("index") or 0)
                payload = encode(chunk, data)
            except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
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
                payload = chunk_message(as_chunk(answer)).SerializeToString()
            else:
                payload = completion_message(answer).SerializeToString()
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
            await trailers_only(
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
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            message = body[:500].decode("utf-8", "replace")
        status = codec.status_for_error(http_status, error_type, error_code)
        await trailers_only(
            self._client_send, 200, status, message or f"HTTP {http_status}", self._cors, self._passed_back,
            self._text,
        )  # fmt: skip


class Splice:
    """The relay's splice target for a gRPC-Web stream: SSE bytes in, gRPC-Web frames out.

    The relay hands the pod's bytes from the pod connection's parser callback to a sink (see
    ``transports/client_socket.py``); this one translates them as ``Call.send`` would (the same
    state: a call's bytes go one way or the other, in order) and passes the frames to the sink of
    the client connection's own target (HTTP/1.1 socket, HTTP/2 or HTTP/3 stream), which keeps its flow
    control and its stop on a client that left. A read with no complete event writes nothing (an
    empty chunk would end an HTTP/1.1 body).
    """

    __slots__ = ("_call", "_socket")

    def __init__(self, call: Call, socket: SpliceTarget) -> None:
        self._call = call
        self._socket = socket

    def writer(self, upstream: Upstream) -> Sink:
        """A sink for the pod's body chunks, as ``SpliceTarget.writer``'s."""
        write = self._socket.writer(upstream)
        frames = self._call._frames
        if self._call._text:
            encode_text = codec.encode_text

            def text_sink(body: bytes) -> None:
                out = frames(body)
                if out:
                    write(encode_text(out))

            return text_sink

        def sink(body: bytes) -> None:
            out = frames(body)
            if out:
                write(out)

        return sink


# Modes of a call's response, as the relay's messages reveal it.
_PENDING = "pending"  # the request body is still to be read
_READ = "read"  # the relay has the request; nothing answered yet
_STREAM = "stream"  # SSE events → message frames
_WHOLE = "whole"  # a whole JSON answer → one message frame
_ERROR = "error"  # a JSON error → Trailers-Only


def too_large(limit: int) -> GatewayError:
    """The relay's own 413 (RESOURCE_EXHAUSTED, as gRPC servers answer an oversized message)."""
    return GatewayError(
        413, f"Request message is larger than the gateway's limit of {limit} bytes.",
        "invalid_request_error", "request_too_large",
    )  # fmt: skip


def header(headers: Collection[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of the first header called ``name`` (lower case), if any."""
    for key, value in headers:
        if key == name:
            return value
    return None


async def trailers_only(
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
