"""A chat-completions client that picks the best transport to the gateway, and says which it used.

``SluicegateClient`` (async) and ``SyncSluicegateClient`` stream OpenAI-style chat completions and
negotiate the transport as a browser does:

- **HTTP/3** when the origin advertised it (``Alt-Svc``, cached per origin with its ``ma``), raced
  against TCP the way Chromium does: QUIC starts first, TCP (TLS, ALPN h2/http1.1) is held back
  ``min(1.5 x smoothed QUIC RTT, 3 s)`` (300 ms when no RTT is known) and the first to finish its
  handshake carries the request. Only connections race, never requests: a chat request is sent
  once, so a race never doubles a generation on the GPUs.
- **Broken alternatives**: QUIC failing where TCP works marks h3 broken for the origin for 300 s,
  doubling per repeat up to ~2 days; while marked the client goes straight to TCP, after expiry it
  tries QUIC again, and a success clears the history (niquests never retries h3).
- **HTTP/2 or HTTP/1.1** over TCP via httpx, as TLS ALPN decides; ``http://`` URLs use HTTP/1.1,
  or h2c with prior knowledge when asked.
- **Server-directed downgrade**: ``Alt-Svc: clear``; HTTP/2 ``HTTP_1_1_REQUIRED`` (RST_STREAM or
  GOAWAY) and HTTP/3 ``H3_VERSION_FALLBACK`` resets (retry over HTTP/1.1 and remember it); 421
  over h3; and the gateway's ``x-sluicegate-downgrade`` header. A request is retried only while
  nothing of its answer has reached the caller.
- **gRPC-Web** (``sluicegate.v1.Inference``) when asked (``transport="grpc-web"``) or when the
  gateway directs it (``x-sluicegate-downgrade: grpc-web``); it is one ``ChatTransport``, the seam
  every transport goes through.

See docs/client.md.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import email.utils
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpcore
import httpx

from transports.altsvc import AltSvcCache, origin_of
from transports.broken_alternatives import BrokenAlternatives
from transports.h3_client import (
    H3_NO_ERROR,
    H3_REQUEST_REJECTED,
    H3_VERSION_FALLBACK,
    H3ClientConnection,
    H3ConnectionLost,
    H3Response,
    H3StreamReset,
    QuicConnectError,
)

log = logging.getLogger("sluicegate.client")

DOWNGRADE_HEADER = "x-sluicegate-downgrade"
HTTP_1_1_REQUIRED = 0xD  # RFC 9113 section 7
DEFAULT_RACE_DELAY = 0.3  # TCP's head start for QUIC when no RTT to the origin is known
MAX_RACE_DELAY = 3.0
MAX_TRIES = 4
TRANSPORTS = ("auto", "h3", "h2", "h1", "grpc-web")
_RANK = {"h1": 1, "h2": 2, "h3": 3}
USER_AGENT = "sluicegate-client/0.1"

Verify = bool | str | os.PathLike[str]
T = TypeVar("T")


# --- errors -------------------------------------------------------------------------------------


class SluicegateError(Exception):
    """An error answer (OpenAI error form) from the gateway or a pod: HTTP status or in-stream.

    ``status`` is the HTTP status (for an in-stream error, the error's numeric ``code`` if it has
    one); ``retry_after`` is in seconds when the server sent ``Retry-After``.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | int | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        transport: str | None = None,
        in_stream: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.transport = transport
        self.in_stream = in_stream

    def __str__(self) -> str:
        where = "in stream" if self.in_stream else f"HTTP {self.status}"
        return f"{where} [{self.type or '?'}/{self.code or '?'}] {self.message}"


class SluicegateTransportError(ConnectionError):
    """No transport could carry the request; ``attempts`` says what was tried and how it failed."""

    def __init__(self, message: str, attempts: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.attempts = list(attempts)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` value (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_payload(
    payload: Any, *, status: int | None, retry_after: float | None, transport: str | None, in_stream: bool
) -> SluicegateError:
    """A typed error from an OpenAI error object ``{"error": {...}}`` (or anything less tidy)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        if in_stream and status is None and isinstance(code, int):
            status = code
        return SluicegateError(
            str(err.get("message") or "error"),
            status=status,
            type=err.get("type"),
            code=code,
            param=err.get("param"),
            retry_after=retry_after,
            transport=transport,
            in_stream=in_stream,
        )
    message = err if isinstance(err, str) else json.dumps(payload)[:500] if payload is not None else "error"
    return SluicegateError(
        message, status=status, retry_after=retry_after, transport=transport, in_stream=in_stream
    )


def error_from_body(
    status: int, body: bytes, retry_after: float | None, transport: str | None
) -> SluicegateError:
    """The typed error for a non-2xx answer, whether or not its body is OpenAI JSON."""
    try:
        payload = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
        return SluicegateError(text, status=status, retry_after=retry_after, transport=transport)
    return error_from_payload(
        payload, status=status, retry_after=retry_after, transport=transport, in_stream=False
    )


# --- SSE ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SSEvent:
    """One dispatched Server-Sent Event: its ``event`` name (default "message") and joined data."""

    event: str
    data: str


class SSEDecoder:
    """Incremental SSE parser (WHATWG rules: LF, CR or CRLF line ends; ``data`` lines joined).

    transports/sse.py looks at complete events in a relay buffer (offsets, first-token test) and
    ignores ``event:`` names; a client needs every event, split across reads, with its name.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SSEvent]:
        """Events completed by ``chunk``."""
        buf = self._buf + chunk
        out: list[SSEvent] = []
        pos = 0
        n = len(buf)
        while pos < n:
            lf = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos)
            if cr != -1 and (lf == -1 or cr < lf):
                if cr == n - 1:
                    break  # a CR at the end may be half of a CRLF: wait for the next byte
                end, nxt = cr, cr + (2 if buf[cr + 1 : cr + 2] == b"\n" else 1)
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            self._line(buf[pos:end], out)
            pos = nxt
        self._buf = buf[pos:]
        return out

    def _line(self, line: bytes, out: list[SSEvent]) -> None:
        if not line:
            if self._data:
                out.append(SSEvent(self._event or "message", "\n".join(self._data)))
            self._event = ""
            self._data = []
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")


# --- the transport seam -------------------------------------------------------------------------


@dataclass
class ChatRequest:
    """One chat request, in every form a transport may want it."""

    url: str
    origin: str
    scheme: str
    host: str
    port: int
    authority: str
    path: str
    headers: list[tuple[str, str]]
    payload: dict[str, Any]
    body: bytes
    stream: bool


class ChatExchange(abc.ABC):
    """One request/response on some transport, once the response headers have arrived."""

    transport: str
    status: int
    headers: list[tuple[str, str]]

    def header_values(self, name: str) -> list[str]:
        """All values of a header, by lower-case name."""
        return [v for k, v in self.headers if k.lower() == name]

    def header(self, name: str) -> str | None:
        """The first value of a header."""
        values = self.header_values(name)
        return values[0] if values else None

    @abc.abstractmethod
    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""

    async def events(self) -> AsyncIterator[SSEvent]:
        """The body as SSE events; a non-SSE transport (gRPC-Web) overrides this."""
        decoder = SSEDecoder()
        async for chunk in self.aiter_bytes():
            for event in decoder.feed(chunk):
                yield event

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the response (and stop the server sending it, if unfinished)."""


class ChatTransport(abc.ABC):
    """A way to carry chat requests; the client's strategies for h3/h2/h1 and the gRPC-Web seam.

    A gRPC-Web implementation opens the request as a gRPC-Web call and returns a ``ChatExchange``
    whose ``events()`` yields each streamed message as an ``SSEvent`` holding the equivalent
    OpenAI chunk JSON, so the rest of the client is the same for every transport.
    """

    name: str = "?"

    @abc.abstractmethod
    async def open(self, request: ChatRequest) -> ChatExchange:
        """Send the request; return once the response headers are in."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class _HttpxExchange(ChatExchange):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.transport = "h2" if response.http_version == "HTTP/2" else "h1"
        self.status = response.status_code
        self.headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in response.headers.raw]

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes():
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


class _H3Exchange(ChatExchange):
    def __init__(self, response: H3Response, read_timeout: float | None) -> None:
        self._response = response
        self._read_timeout = read_timeout
        self.transport = "h3"
        self.status = response.status
        self.headers = response.headers

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes(self._read_timeout):
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


# --- TCP: httpx with connections that can be opened before the request ------------------------


class _Preconnected(httpcore.AsyncNetworkStream):
    """A stream whose TCP and TLS handshakes finished during the race; httpcore's TLS step is a no-op."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        return self._stream

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _ParkingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, plus a slot per (host, port) for a connection won in a race.

    The request that won the race takes it at once; one left over (a concurrent request found
    another connection) is not trusted after ``PARK_MAX_AGE`` seconds.
    """

    PARK_MAX_AGE = 5.0

    def __init__(self) -> None:
        self.inner = httpcore.AnyIOBackend()
        self._parked: dict[tuple[str, int], tuple[httpcore.AsyncNetworkStream, float]] = {}

    async def park(self, host: str, port: int, stream: httpcore.AsyncNetworkStream) -> None:
        old = self._parked.pop((host.lower(), port), None)
        self._parked[(host.lower(), port)] = (stream, time.monotonic())
        if old is not None:
            await old[0].aclose()

    async def discard(self, host: str, port: int) -> None:
        parked = self._parked.pop((host.lower(), port), None)
        if parked is not None:
            await parked[0].aclose()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        parked = self._parked.pop((host.lower(), port), None)
        if parked is not None:
            if time.monotonic() - parked[1] <= self.PARK_MAX_AGE:
                return _Preconnected(parked[0])
            await parked[0].aclose()
        return await self.inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self.inner.connect_unix_socket(path, timeout=timeout, socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)

    async def aclose(self) -> None:
        for stream, _ in list(self._parked.values()):
            with contextlib.suppress(Exception):
                await stream.aclose()
        self._parked.clear()


class _PoolTransport(httpx.AsyncHTTPTransport):
    """httpx's transport on a connection pool that uses ``_ParkingBackend``.

    httpx does not take a network backend, so the pool it built is swapped for one that does;
    ``_pool`` is the one private name relied on (stable since httpx 0.18).
    """

    def __init__(
        self, ssl_context: ssl.SSLContext, http1: bool, http2: bool, backend: _ParkingBackend
    ) -> None:
        super().__init__(verify=ssl_context, http1=http1, http2=http2, trust_env=False)
        if not hasattr(self, "_pool"):  # pragma: no cover - an httpx that changed its insides
            raise RuntimeError("this httpx version keeps its connection pool elsewhere")
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context, http1=http1, http2=http2, max_connections=100, network_backend=backend
        )

    @property
    def pool(self) -> httpcore.AsyncConnectionPool:
        return self._pool


def ssl_context(verify: Verify) -> ssl.SSLContext:
    """A TLS client context: ``verify`` True (system/certifi CAs), False, or a CA bundle path."""
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if verify is True:
        try:
            import certifi

            return ssl.create_default_context(cafile=certifi.where())
        except ImportError:  # pragma: no cover
            return ssl.create_default_context()
    return ssl.create_default_context(cafile=os.fspath(verify))


class HttpxTransport(ChatTransport):
    """Chat over TCP with httpx. ``kind``: "auto" (ALPN h2 then http/1.1), "h2" (h2 only, h2c on
    http://) or "h1"; the exchange reports what was actually negotiated."""

    def __init__(self, kind: str, verify: Verify, connect_timeout: float, read_timeout: float | None) -> None:
        self.name = kind
        http1, http2 = kind != "h2", kind != "h1"
        self.ssl = ssl_context(verify)
        self.ssl.set_alpn_protocols(
            ["http/1.1", "h2"] if http1 and http2 else ["h2"] if http2 else ["http/1.1"]
        )
        self.backend = _ParkingBackend()
        self._transport = _PoolTransport(self.ssl, http1, http2, self.backend)
        self.connect_timeout = connect_timeout
        self.client = httpx.AsyncClient(
            transport=self._transport,
            timeout=httpx.Timeout(connect_timeout, read=read_timeout),
            trust_env=False,
        )

    def has_connection(self, scheme: str, host: str, port: int) -> bool:
        """Whether the pool holds an established connection that can take a request now."""
        origin = httpcore.Origin(scheme.encode(), host.encode(), port)
        return any(
            conn.can_handle_request(origin) and conn.is_available() and conn.info() != "CONNECTING"
            for conn in self._transport.pool.connections
        )

    async def ensure_connection(self, scheme: str, host: str, port: int) -> bool:
        """Have a connection ready for the origin: reuse one, or do the TCP (and TLS) handshake now.

        Returns True when an existing connection will carry the request.
        """
        if self.has_connection(scheme, host, port):
            return True
        stream = await self.backend.inner.connect_tcp(host, port, timeout=self.connect_timeout)
        if scheme == "https":
            try:
                stream = await stream.start_tls(self.ssl, server_hostname=host, timeout=self.connect_timeout)
            except BaseException:
                await stream.aclose()
                raise
        await self.backend.park(host, port, stream)
        return False

    async def open(self, request: ChatRequest) -> ChatExchange:
        req = self.client.build_request("POST", request.url, content=request.body, headers=request.headers)
        response = await self.client.send(req, stream=True)
        return _HttpxExchange(response)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.backend.aclose()


# --- gRPC-Web ------------------------------------------------------------------------------------

GRPC_SERVICE = "sluicegate.v1.Inference"
# gRPC status -> the HTTP status the gateway chose it for (transports/grpc_web.HTTP_TO_GRPC, inverted)
_GRPC_TO_HTTP = {1: 499, 3: 400, 4: 504, 5: 404, 7: 403, 8: 429, 9: 412, 10: 409, 12: 501, 13: 500,
                 14: 503, 16: 401}  # fmt: skip


class _GrpcWebExchange(ChatExchange):
    """A gRPC-Web call's response, read as the OpenAI chunks (or completion) it carries.

    A Trailers-Only answer (the status in the headers) looks like the HTTP error it stands for,
    so the client's error handling is the same as for SSE; a failing status in the trailers after
    messages raises ``SluicegateError`` (in stream).
    """

    def __init__(self, response: httpx.Response) -> None:
        from google.protobuf import json_format

        from gateway.proto.sluicegate.v1 import inference_pb2 as pb
        from transports import grpc_web as codec

        self._pb, self._json_format, self._codec = pb, json_format, codec
        self._response = response
        self.transport = "grpc-web"
        self.via = "h2" if response.http_version == "HTTP/2" else "h1"
        self.headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in response.headers.raw]
        self._early = self._status_in(dict(self.headers)) if response.status_code == 200 else None
        if self._early is not None and self._early[0] != 0:
            self.status = _GRPC_TO_HTTP.get(self._early[0], 500)
        else:
            self.status = response.status_code

    def _status_in(self, fields: dict[str, str]) -> tuple[int, str] | None:
        if "grpc-status" not in fields:
            return None
        raw = fields.get("grpc-message", "")
        return int(fields["grpc-status"]), self._codec.percent_decode(raw.encode("latin-1"))

    def _name(self, status: int) -> str:
        try:
            return self._codec.Status(status).name
        except ValueError:
            return str(status)

    def _error_body(self, status: int, message: str) -> bytes:
        error = {"message": message, "type": "grpc_error", "code": self._name(status)}
        return json.dumps({"error": error}).encode()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes():
            yield chunk

    async def _messages(self) -> AsyncIterator[bytes]:
        """Message payloads; raises on a failing trailers status or a truncated body."""
        deframer = self._codec.Deframer()
        trailers: dict[str, str] | None = None
        async for chunk in self.aiter_bytes():
            for frame in deframer.feed(chunk):
                if frame.is_trailers:
                    trailers = self._codec.parse_trailers(frame.payload)
                elif frame.is_compressed:
                    raise SluicegateError(
                        "compressed gRPC-Web message (not negotiated)", transport="grpc-web"
                    )
                else:
                    yield frame.payload
        status = self._status_in(trailers or {}) if trailers is not None else self._early
        if status is None:
            raise SluicegateError(
                "gRPC-Web answer ended without trailers", transport="grpc-web", in_stream=True
            )
        if status[0] != 0:
            name = self._name(status[0])
            raise SluicegateError(
                status[1] or f"gRPC status {name}",
                status=_GRPC_TO_HTTP.get(status[0], 500),
                type="grpc_error",
                code=name,
                retry_after=parse_retry_after(self.header("retry-after")),
                transport="grpc-web",
                in_stream=True,
            )

    async def events(self) -> AsyncIterator[SSEvent]:
        to_dict = self._json_format.MessageToDict
        async for payload in self._messages():
            chunk = self._pb.ChatCompletionChunk.FromString(payload)
            yield SSEvent("message", json.dumps(to_dict(chunk, preserving_proto_field_name=True)))
        yield SSEvent("message", "[DONE]")

    async def read(self) -> bytes:
        if self._early is not None and self._early[0] != 0:
            return self._error_body(*self._early)
        if self.status >= 300:
            return await self._response.aread()
        payloads = [payload async for payload in self._messages()]
        if not payloads:
            raise SluicegateError("gRPC-Web answer without a message", transport="grpc-web")
        answer = self._pb.ChatCompletion.FromString(payloads[-1])
        return json.dumps(self._json_format.MessageToDict(answer, preserving_proto_field_name=True)).encode()

    async def aclose(self) -> None:
        await self._response.aclose()


class GrpcWebTransport(ChatTransport):
    """Chat over gRPC-Web (``sluicegate.v1.Inference``, binary protobuf) on httpx: h2 where ALPN
    offers it, else HTTP/1.1. The request's OpenAI parameters that the proto has no field for are
    left out (see proto/sluicegate/v1/inference.proto)."""

    name = "grpc-web"

    def __init__(self, verify: Verify, connect_timeout: float, read_timeout: float | None) -> None:
        self._http = HttpxTransport("auto", verify, connect_timeout, read_timeout)

    async def open(self, request: ChatRequest) -> ChatExchange:
        from google.protobuf import json_format

        from gateway.proto.sluicegate.v1 import inference_pb2 as pb
        from transports import grpc_web as codec

        message = json_format.ParseDict(
            request.payload, pb.ChatCompletionRequest(), ignore_unknown_fields=True
        )
        method = "StreamChatCompletion" if request.stream else "ChatCompletion"
        prefix = urlsplit(request.url).path.rsplit("/v1/", 1)[0].rstrip("/")
        url = f"{request.scheme}://{request.authority}{prefix}/{GRPC_SERVICE}/{method}"
        skip = {"content-type", "accept"}
        headers = [(k, v) for k, v in request.headers if k not in skip]
        headers += [
            ("content-type", codec.CONTENT_TYPE_PROTO.decode()),
            ("accept", codec.CONTENT_TYPE_PROTO.decode()),
            ("x-grpc-web", "1"),
        ]
        client = self._http.client
        body = codec.encode_message(message.SerializeToString())
        response = await client.send(
            client.build_request("POST", url, content=body, headers=headers), stream=True
        )
        return _GrpcWebExchange(response)

    async def aclose(self) -> None:
        await self._http.aclose()


# --- results ------------------------------------------------------------------------------------


@dataclass
class Negotiation:
    """What the client did to carry one request: useful in logs, asserted on in tests.

    Times are seconds from the start of the request.
    """

    transport: str | None = None
    attempts: list[str] = field(default_factory=list)
    raced: bool = False
    race_delay: float | None = None
    tcp_started_after: float | None = None
    h3_error: str | None = None
    headers_after: float | None = None
    first_token_after: float | None = None
    started: float = field(default=0.0, repr=False)
    tries: int = field(default=0, repr=False)
    current: str | None = field(default=None, repr=False)
    avoid_h3: bool = field(default=False, repr=False)
    h3_reused: bool = field(default=False, repr=False)
    h3_conn: H3ClientConnection | None = field(default=None, repr=False)

    def note(self, text: str) -> None:
        self.attempts.append(text)
        log.debug("negotiation: %s", text)


@dataclass
class ChatResult:
    """A whole (non-streamed) chat completion and how it travelled."""

    text: str
    transport: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    raw: dict[str, Any]
    negotiation: Negotiation


class ChatStream:
    """A streamed chat completion: ``async for token in stream``; ``async with`` closes it early.

    ``transport``, ``status`` and ``headers`` are set once the response has begun (after the first
    ``__anext__`` or ``await stream.start()``); ``text`` grows as tokens arrive.
    """

    def __init__(self, client: SluicegateClient, request: ChatRequest) -> None:
        self._client = client
        self._request = request
        self._exchange: ChatExchange | None = None
        self._events: AsyncIterator[SSEvent] | None = None
        self._done = False
        self.negotiation = Negotiation()
        self.tokens: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []

    @property
    def transport(self) -> str | None:
        """ "h3", "h2", "h1" or "grpc-web" once the response has begun."""
        return self.negotiation.transport

    @property
    def text(self) -> str:
        """The tokens so far, joined."""
        return "".join(self.tokens)

    async def start(self) -> ChatStream:
        """Negotiate and send the request; returns once the response headers are in."""
        if self._exchange is None and not self._done:
            nego = self.negotiation
            if not nego.started:
                nego.started = asyncio.get_running_loop().time()
            exchange = await self._client._open(self._request, nego)
            self._exchange = exchange
            self.status, self.headers = exchange.status, exchange.headers
            if exchange.status >= 300:
                await self._fail_status(exchange)
            self._events = exchange.events()
        return self

    async def _fail_status(self, exchange: ChatExchange) -> None:
        try:
            body = await exchange.read()
        except Exception:
            body = b""
        await self.aclose()
        raise error_from_body(
            exchange.status, body, parse_retry_after(exchange.header("retry-after")), exchange.transport
        )

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        while True:
            assert self._events is not None and self._exchange is not None
            try:
                event = await anext(self._events)
            except StopAsyncIteration:
                await self.aclose()
                raise
            except Exception as exc:
                exchange = self._exchange
                await self._release()
                if not self.tokens and await self._client._recover(
                    exc, self._request, self.negotiation, True
                ):
                    await self.start()
                    continue
                await self.aclose()
                wrapped = self._client._wrap(exc, self.negotiation, exchange.transport)
                if wrapped is exc:
                    raise
                raise wrapped from exc
            try:
                token = self._on_event(event)
            except StopAsyncIteration:
                await self._drain()
                await self.aclose()
                raise
            except SluicegateError:
                await self.aclose()
                raise
            if token:
                if not self.tokens:
                    self.negotiation.first_token_after = (
                        asyncio.get_running_loop().time() - self.negotiation.started
                    )
                self.tokens.append(token)
                return token

    def _on_event(self, event: SSEvent) -> str | None:
        data = event.data
        if data.strip() == "[DONE]":
            self._done = True
            raise StopAsyncIteration
        try:
            payload = json.loads(data)
        except ValueError:
            if event.event == "error":
                self._done = True
                raise SluicegateError(data, transport=self.transport, in_stream=True) from None
            return None  # not ours to judge: skip what we cannot read
        if event.event == "error" or (isinstance(payload, dict) and "error" in payload):
            self._done = True
            raise error_from_payload(
                payload, status=None, retry_after=None, transport=self.transport, in_stream=True
            )
        if not isinstance(payload, dict):
            return None
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(content, str) and content:
                return content
        return None

    async def _drain(self) -> None:
        """Read what follows ``[DONE]`` (the body's end) so the connection stays reusable."""
        if self._events is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                async for _ in self._events:
                    pass

    async def _release(self) -> None:
        exchange, self._exchange, self._events = self._exchange, None, None
        if exchange is not None:
            with contextlib.suppress(Exception):
                await exchange.aclose()

    async def aclose(self) -> None:
        """Stop reading; an unfinished response is cancelled (the gateway aborts the generation)."""
        self._done = True
        await self._release()
        self._client._after_exchange(self.negotiation)

    async def __aenter__(self) -> ChatStream:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# --- the client ---------------------------------------------------------------------------------


@dataclass
class _QuicAttempt:
    """One QUIC handshake to an alternative, shared by the requests that race it."""

    key: tuple[str, str, int]
    task: asyncio.Task[H3ClientConnection]
    tcp_won: bool = False
    reported: bool = False


@dataclass
class _LiveQuic:
    key: tuple[str, str, int]
    conn: H3ClientConnection
    in_use: int = 0
    retired: bool = False


class SluicegateClient:
    """Async chat-completions client with transport negotiation (see the module docstring).

    ``transport``: "auto" (negotiate), or "h3" / "h2" / "h1" / "grpc-web" to use only that one
    (no fallback, no downgrade). ``clock`` drives the Alt-Svc and broken-alternative memories
    (inject one to test expiry). ``grpc_web``: True for the built-in gRPC-Web transport, False to
    refuse gRPC-Web even when the server directs it, or a ``ChatTransport`` of your own; it is used
    when ``transport="grpc-web"`` or when the server directs it.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        verify: Verify = True,
        transport: str = "auto",
        headers: dict[str, str] | None = None,
        h2c: bool = False,
        connect_timeout: float = 10.0,
        read_timeout: float | None = 300.0,
        race_delay: float = DEFAULT_RACE_DELAY,
        max_race_delay: float = MAX_RACE_DELAY,
        quic_handshake_timeout: float = 10.0,
        quic_idle_timeout: float = 60.0,
        downgrade_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        grpc_web: ChatTransport | bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        if transport == "h3" and parts.scheme != "https":
            raise ValueError("HTTP/3 needs an https:// base URL")
        if transport == "grpc-web" and grpc_web is False:
            raise ValueError("transport='grpc-web' with grpc_web=False")
        self.base_url = base_url.rstrip("/")
        self.origin = origin_of(base_url)
        self.transport = transport
        self.verify = verify
        self.h2c = h2c
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.race_delay = race_delay
        self.max_race_delay = max_race_delay
        self.quic_handshake_timeout = quic_handshake_timeout
        self.quic_idle_timeout = quic_idle_timeout
        self.downgrade_ttl = downgrade_ttl
        self.clock = clock
        self.altsvc = AltSvcCache(clock)
        self.broken = BrokenAlternatives(clock)
        self._grpc_option = grpc_web
        self._grpc: ChatTransport | None = grpc_web if isinstance(grpc_web, ChatTransport) else None
        self._headers = [("user-agent", USER_AGENT), *((k.lower(), v) for k, v in (headers or {}).items())]
        if api_key:
            self._headers.append(("authorization", f"Bearer {api_key}"))
        self._caps: dict[str, tuple[str, float]] = {}
        self._srtt: dict[tuple[str, str, int], float] = {}
        self._quic: dict[str, _LiveQuic] = {}
        self._retired: list[_LiveQuic] = []
        self._attempts: dict[tuple[str, str, int], _QuicAttempt] = {}
        self._tcp: dict[str, HttpxTransport] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # public API

    def stream_chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> ChatStream:
        """A streamed chat completion: ``async for token in client.stream_chat(...)``."""
        return ChatStream(self, self._request(model, messages, params, stream=True))

    async def complete_chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> ChatResult:
        """A whole chat completion (``stream: false``), negotiated like a stream."""
        request = self._request(model, messages, params, stream=False)
        nego = Negotiation(started=asyncio.get_running_loop().time())
        try:
            while True:
                exchange = await self._open(request, nego)
                try:
                    body = await exchange.read()
                except Exception as exc:
                    await exchange.aclose()
                    if await self._recover(exc, request, nego, True):
                        continue
                    wrapped = self._wrap(exc, nego, exchange.transport)
                    if wrapped is exc:
                        raise
                    raise wrapped from exc
                await exchange.aclose()
                break
        finally:
            self._after_exchange(nego)
        if exchange.status >= 300:
            retry_after = parse_retry_after(exchange.header("retry-after"))
            raise error_from_body(exchange.status, body, retry_after, exchange.transport)
        try:
            raw = json.loads(body)
            choice = raw["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise SluicegateError(
                "malformed completion body", status=exchange.status, transport=exchange.transport
            ) from None
        message = choice.get("message") or {}
        return ChatResult(
            text=message.get("content") or choice.get("text") or "",
            transport=exchange.transport,
            finish_reason=choice.get("finish_reason"),
            usage=raw.get("usage"),
            raw=raw,
            negotiation=nego,
        )

    def transport_cap(self, origin: str | None = None) -> str:
        """The best transport the server currently allows for ``origin`` (the base origin by default)."""
        return self._cap(origin or self.origin)

    async def wait_background(self) -> None:
        """Wait for QUIC handshakes that lost a race to finish (and mark or confirm h3)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close_connections(self) -> None:
        """Close pooled connections but keep what was learnt (Alt-Svc, broken marks, RTTs, caps).

        For a network change, or to make the next request negotiate from scratch.
        """
        for live in [*self._quic.values(), *self._retired]:
            await live.conn.aclose()
        self._quic.clear()
        self._retired.clear()
        for tcp in list(self._tcp.values()):
            await tcp.aclose()
        self._tcp.clear()
        if self._grpc is not None and not isinstance(self._grpc_option, ChatTransport):
            await self._grpc.aclose()  # the built-in one: made again on demand
            self._grpc = None

    async def aclose(self) -> None:
        """Close every connection and stop background handshakes."""
        for attempt in list(self._attempts.values()):
            attempt.task.cancel()
        await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.close_connections()
        if self._grpc is not None:
            await self._grpc.aclose()

    async def __aenter__(self) -> SluicegateClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # requests

    def _request(
        self, model: str, messages: list[dict[str, Any]], params: dict[str, Any], stream: bool
    ) -> ChatRequest:
        parts = urlsplit(self.base_url)
        prefix = parts.path.rstrip("/")
        path = prefix + ("/chat/completions" if prefix.endswith("/v1") else "/v1/chat/completions")
        payload = {"model": model, "messages": messages, **params, "stream": stream}
        headers = [
            *self._headers,
            ("content-type", "application/json"),
            ("accept", "text/event-stream" if stream else "application/json"),
        ]
        host = (parts.hostname or "").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return ChatRequest(
            url=f"{parts.scheme}://{parts.netloc}{path}",
            origin=self.origin,
            scheme=parts.scheme,
            host=host,
            port=port,
            authority=parts.netloc,
            path=path,
            headers=headers,
            payload=payload,
            body=json.dumps(payload, separators=(",", ":")).encode(),
            stream=stream,
        )

    def _grpc_web(self) -> ChatTransport:
        if self._grpc is None:
            self._grpc = GrpcWebTransport(self.verify, self.connect_timeout, self.read_timeout)
        return self._grpc

    def _tcp_transport(self, kind: str) -> HttpxTransport:
        tcp = self._tcp.get(kind)
        if tcp is None:
            tcp = self._tcp[kind] = HttpxTransport(kind, self.verify, self.connect_timeout, self.read_timeout)
        return tcp

    async def _open(self, request: ChatRequest, nego: Negotiation) -> ChatExchange:
        """Negotiate and send; retry on server-directed downgrades and early transport failures."""
        loop = asyncio.get_running_loop()
        if not nego.started:
            nego.started = loop.time()
        while True:
            nego.tries += 1
            try:
                exchange = await self._open_once(request, nego)
            except (SluicegateError, asyncio.CancelledError):
                raise
            except Exception as exc:
                if await self._recover(exc, request, nego, False):
                    continue
                self._after_exchange(nego)
                wrapped = self._wrap(exc, nego, nego.current)
                if wrapped is exc:
                    raise
                raise wrapped from exc
            nego.transport = exchange.transport
            nego.headers_after = loop.time() - nego.started
            self._observe(request, exchange, nego)
            if exchange.status >= 300 and self._directed_retry(request, exchange, nego):
                with contextlib.suppress(Exception):
                    await exchange.aclose()
                self._after_exchange(nego)
                continue
            return exchange

    async def _open_once(self, request: ChatRequest, nego: Negotiation) -> ChatExchange:
        mode = self.transport
        if mode == "grpc-web" or (
            mode == "auto" and self._cap(request.origin) == "grpc-web" and self._grpc_option is not False
        ):
            nego.current = "grpc-web"
            return await self._grpc_web().open(request)
        if mode == "h3":
            nego.current = "h3"
            conn = await self._forced_h3(request, nego)
            return await self._h3_open(conn, request, nego)
        if mode in ("h2", "h1"):
            return await self._tcp_open(mode, request, nego)
        if request.scheme == "http":
            cap = self._cap(request.origin)
            return await self._tcp_open("h2" if self.h2c and cap != "h1" else "h1", request, nego)
        cap = self._cap(request.origin)
        if cap == "h3" and not nego.avoid_h3:
            live = self._live_quic(request.origin)
            if live is not None:
                nego.h3_reused = True
                nego.note("h3: reusing the open QUIC connection")
                return await self._h3_open(live, request, nego)
            alt = self.altsvc.lookup(request.origin, "h3")
            if alt is not None:
                host, port = alt.authority(request.host)
                key = (request.origin, host, port)
                if self.broken.is_broken(key):
                    nego.note(f"h3 at {host}:{port} is marked broken: straight to TCP")
                else:
                    winner = await self._race(request, key, nego)
                    if winner is not None:
                        return await self._h3_open(winner, request, nego)
                    return await self._tcp_open("auto", request, nego)
        return await self._tcp_open("h1" if cap == "h1" else "auto", request, nego)

    async def _tcp_open(self, kind: str, request: ChatRequest, nego: Negotiation) -> ChatExchange:
        nego.current = kind
        return await self._tcp_transport(kind).open(request)

    async def _h3_open(
        self, conn: H3ClientConnection, request: ChatRequest, nego: Negotiation
    ) -> ChatExchange:
        nego.current = "h3"
        nego.h3_conn = conn
        live = self._quic.get(request.origin)
        if live is not None and live.conn is conn:
            live.in_use += 1
        response = await conn.request(
            "POST",
            request.authority,
            request.path,
            [(k, v) for k, v in request.headers if k != "host"],
            request.body,
            read_timeout=self.read_timeout,
        )
        return _H3Exchange(response, self.read_timeout)

    def _after_exchange(self, nego: Negotiation) -> None:
        """An exchange is over: let a retired QUIC connection close once its last request ends."""
        conn, nego.h3_conn = nego.h3_conn, None
        if conn is None:
            return
        for origin, live in list(self._quic.items()):
            if live.conn is conn:
                live.in_use = max(0, live.in_use - 1)
                if live.retired and live.in_use == 0:
                    del self._quic[origin]
                    self._spawn(conn.aclose())
                return
        for retired in self._retired:
            if retired.conn is conn:
                retired.in_use = max(0, retired.in_use - 1)
                if retired.in_use == 0:
                    self._retired.remove(retired)
                    self._spawn(conn.aclose())
                return

    # QUIC and the race

    def _live_quic(self, origin: str) -> H3ClientConnection | None:
        live = self._quic.get(origin)
        if live is None:
            return None
        if not live.conn.is_usable:
            del self._quic[origin]
            self._spawn(live.conn.aclose())
            return None
        return live.conn

    def _retire_quic(self, origin: str) -> None:
        """No new requests on the origin's QUIC connection; close it when its requests finish."""
        live = self._quic.pop(origin, None)
        if live is None:
            return
        if live.in_use == 0:
            self._spawn(live.conn.aclose())
        else:
            live.retired = True
            self._retired.append(live)

    def _race_delay_for(self, key: tuple[str, str, int]) -> float:
        srtt = self._srtt.get(key)
        if srtt is None:
            return self.race_delay
        return min(1.5 * srtt, self.max_race_delay)

    def _quic_attempt(self, request: ChatRequest, key: tuple[str, str, int]) -> _QuicAttempt:
        attempt = self._attempts.get(key)
        if attempt is None or attempt.task.done():
            task = asyncio.ensure_future(self._connect_quic(request, key))
            attempt = self._attempts[key] = _QuicAttempt(key, task)
            self._track(task)
        return attempt

    async def _connect_quic(self, request: ChatRequest, key: tuple[str, str, int]) -> H3ClientConnection:
        _, host, port = key
        try:
            conn = await H3ClientConnection.connect(
                host,
                port,
                server_name=request.host,
                verify=self.verify,
                handshake_timeout=self.quic_handshake_timeout,
                idle_timeout=self.quic_idle_timeout,
            )
        except QuicConnectError:
            attempt = self._attempts.get(key)
            if attempt is not None and attempt.tcp_won:
                self._mark_h3_broken(attempt)
            raise
        finally:
            attempt = self._attempts.get(key)
            if attempt is not None and attempt.task is asyncio.current_task():
                del self._attempts[key]
        self.broken.confirm(key)
        rtt = conn.smoothed_rtt
        if rtt:
            self._srtt[key] = rtt
        if self._cap(request.origin) != "h3" or self.altsvc.lookup(request.origin, "h3") is None:
            await conn.aclose()  # told to stop using h3 while the handshake ran
            raise QuicConnectError("h3 no longer allowed for this origin")
        old = self._quic.get(request.origin)
        if old is not None and old.conn is not conn:
            self._retire_quic(request.origin)
        self._quic[request.origin] = _LiveQuic(key, conn)
        return conn

    def _mark_h3_broken(self, attempt: _QuicAttempt) -> None:
        if not attempt.reported:
            attempt.reported = True
            self._mark_broken(attempt.key)

    def _mark_broken(self, key: tuple[str, str, int]) -> None:
        delay = self.broken.mark_broken(key)
        log.info("h3 at %s:%d for %s marked broken for %.0f s", key[1], key[2], key[0], delay)

    def _tcp_won(self, attempt: _QuicAttempt) -> None:
        """TCP worked in a race: a QUIC failure, now or later, marks h3 broken (Chromium's rule)."""
        attempt.tcp_won = True
        task = attempt.task
        if task.done() and (task.cancelled() or task.exception() is not None):
            self._mark_h3_broken(attempt)

    async def _race(
        self, request: ChatRequest, key: tuple[str, str, int], nego: Negotiation
    ) -> H3ClientConnection | None:
        """QUIC vs TCP, TCP held back: the QUIC connection if it wins, None when TCP is ready."""
        loop = asyncio.get_running_loop()
        attempt = self._quic_attempt(request, key)
        quic = attempt.task
        delay = self._race_delay_for(key)
        nego.raced, nego.race_delay = True, delay
        done, _ = await asyncio.wait({quic}, timeout=delay)
        if quic in done and _succeeded(quic):
            nego.note(f"h3: QUIC handshake done within the {delay * 1000:.0f} ms head start")
            return quic.result()
        tcp_transport = self._tcp_transport("auto")
        tcp = asyncio.ensure_future(
            tcp_transport.ensure_connection(request.scheme, request.host, request.port)
        )
        nego.tcp_started_after = loop.time() - nego.started
        if quic.done():
            nego.h3_error = _describe(quic)
            nego.note(f"h3 failed before the head start ended ({nego.h3_error}): TCP now")
        tcp_noted = False
        try:
            while True:
                await asyncio.wait(
                    [t for t in (quic, tcp) if not t.done()], return_when=asyncio.FIRST_COMPLETED
                )
                if _succeeded(quic):
                    nego.note("h3: QUIC won the race")
                    if _succeeded(tcp):
                        await tcp_transport.backend.discard(request.host, request.port)
                    tcp.cancel()
                    return quic.result()
                if quic.done() and nego.h3_error is None:
                    nego.h3_error = _describe(quic)
                    nego.note(f"h3 failed: {nego.h3_error}")
                if _succeeded(tcp):
                    self._tcp_won(attempt)
                    nego.note(
                        "TCP won the race" + ("" if quic.done() else "; QUIC carries on in the background")
                    )
                    return None
                if tcp.done() and quic.done():
                    raise SluicegateTransportError(
                        f"neither QUIC ({_describe(quic)}) nor TCP ({_describe(tcp)}) "
                        f"reached {request.origin}",
                        nego.attempts,
                    ) from (tcp.exception() if not tcp.cancelled() else None)
                if tcp.done() and not tcp_noted:
                    tcp_noted = True
                    nego.note(f"TCP failed ({_describe(tcp)}): waiting for QUIC")
        except BaseException:
            tcp.cancel()
            raise

    async def _forced_h3(self, request: ChatRequest, nego: Negotiation) -> H3ClientConnection:
        live = self._live_quic(request.origin)
        if live is not None:
            return live
        alt = self.altsvc.lookup(request.origin, "h3")
        host, port = alt.authority(request.host) if alt else (request.host, request.port)
        key = (request.origin, host, port)
        conn = await H3ClientConnection.connect(
            host,
            port,
            server_name=request.host,
            verify=self.verify,
            handshake_timeout=self.quic_handshake_timeout,
            idle_timeout=self.quic_idle_timeout,
        )
        if conn.smoothed_rtt:
            self._srtt[key] = conn.smoothed_rtt
        self._quic[request.origin] = _LiveQuic(key, conn)
        return conn

    # what the server said

    def _cap(self, origin: str) -> str:
        cap = self._caps.get(origin)
        if cap is None:
            return "h3"
        if self.clock() >= cap[1]:
            del self._caps[origin]
            return "h3"
        return cap[0]

    def _set_cap(
        self, origin: str, level: str, ttl: float, why: str, nego: Negotiation | None = None
    ) -> None:
        if level == "h3":
            self._caps.pop(origin, None)
            return
        self._caps[origin] = (level, self.clock() + ttl)
        if level != "grpc-web" and _RANK[level] < 3:
            self._retire_quic(origin)
        if nego is not None:
            nego.note(f"server directed {level} ({why}) for {ttl:.0f} s")
        log.info("%s: at most %s for %.0f s (%s)", origin, level, ttl, why)

    def _observe(self, request: ChatRequest, exchange: ChatExchange, nego: Negotiation) -> None:
        """Take in what a response says about transports: Alt-Svc and the downgrade header."""
        alt_svc = exchange.header_values("alt-svc")
        if alt_svc:
            self.altsvc.update(request.origin, alt_svc)
            if self.altsvc.lookup(request.origin, "h3") is None and request.origin in self._quic:
                nego.note("Alt-Svc no longer offers h3: retiring the QUIC connection")
                self._retire_quic(request.origin)
        directive = exchange.header(DOWNGRADE_HEADER)
        if directive:
            parsed = parse_downgrade(directive)
            if parsed is None:
                log.warning("ignoring malformed %s: %r", DOWNGRADE_HEADER, directive)
            else:
                level, ttl = parsed
                if level == "grpc-web" and self._grpc_option is False:
                    nego.note("server asked for gRPC-Web, which this client has not been given")
                else:
                    self._set_cap(
                        request.origin,
                        level,
                        ttl if ttl is not None else self.downgrade_ttl,
                        DOWNGRADE_HEADER,
                        nego,
                    )

    def _directed_retry(self, request: ChatRequest, exchange: ChatExchange, nego: Negotiation) -> bool:
        """After an error status, was the server telling us to come back another way?"""
        if self.transport != "auto" or nego.tries >= MAX_TRIES:
            return False
        if exchange.status == 421 and exchange.transport == "h3":
            nego.avoid_h3 = True
            nego.note("421 Misdirected Request over h3: retrying over TCP")
            return True
        if exchange.header(DOWNGRADE_HEADER):
            cap = self._cap(request.origin)
            if cap == "grpc-web" and self._grpc_option is not False and exchange.transport != "grpc-web":
                return True
            if cap in _RANK and _RANK[cap] < _RANK.get(exchange.transport, 0):
                nego.note(f"HTTP {exchange.status} with {DOWNGRADE_HEADER}: retrying over {cap}")
                return True
        return False

    async def _recover(
        self, exc: BaseException, request: ChatRequest, nego: Negotiation, after_headers: bool
    ) -> bool:
        """Decide whether a failure (before any token was delivered) is retried another way."""
        if self.transport != "auto" or nego.tries >= MAX_TRIES:
            return False
        if nego.current == "h3":
            conn = nego.h3_conn
            self._after_exchange(nego)
            if isinstance(exc, H3StreamReset):
                if exc.error_code == H3_VERSION_FALLBACK:
                    self._set_cap(request.origin, "h1", self.downgrade_ttl, "H3_VERSION_FALLBACK", nego)
                    return True
                nego.avoid_h3 = True
                kind = (
                    "H3_REQUEST_REJECTED"
                    if exc.error_code == H3_REQUEST_REJECTED
                    else f"0x{exc.error_code:x}"
                )
                nego.note(f"h3 stream reset ({kind}) before any token: retrying over TCP")
                return True
            if isinstance(exc, TimeoutError):
                return False  # the server may be generating: a retry could double the work
            live = self._quic.get(request.origin)
            key = live.key if live is not None else None
            if live is not None and (conn is None or live.conn is conn):
                del self._quic[request.origin]
                self._spawn(live.conn.aclose())
            graceful = isinstance(exc, H3ConnectionLost) and exc.error_code in (0, H3_NO_ERROR)
            if nego.h3_reused and graceful and not after_headers:
                nego.note("the reused QUIC connection had closed: negotiating again")
                nego.h3_reused = False
                return True
            nego.avoid_h3 = True
            if key is not None:
                self._mark_broken(key)
            nego.h3_error = str(exc)
            nego.note(f"h3 failed after the handshake ({exc}): marked broken, retrying over TCP")
            return True
        if nego.current in ("auto", "h2") and _h2_error_code(exc) == HTTP_1_1_REQUIRED:
            if request.scheme == "http" and not self.h2c:
                return False
            self._set_cap(request.origin, "h1", self.downgrade_ttl, "HTTP_1_1_REQUIRED", nego)
            return True
        return False

    def _wrap(self, exc: BaseException, nego: Negotiation, transport: str | None) -> BaseException:
        if isinstance(exc, SluicegateError | SluicegateTransportError):
            return exc
        nego.note(f"{transport or '?'} failed: {type(exc).__name__}: {exc}")
        return SluicegateTransportError(
            f"{transport or 'transport'} failed: {type(exc).__name__}: {exc}", nego.attempts
        )

    # tasks

    def _spawn(self, coro: Awaitable[Any]) -> None:
        self._track(asyncio.ensure_future(coro))

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(_forget(self._background))


def parse_downgrade(value: str) -> tuple[str, float | None] | None:
    """``x-sluicegate-downgrade: h2 | h1 | h3 | grpc-web [; ma=<seconds>]`` -> (level, ttl or None)."""
    head, *params = [part.strip() for part in value.split(";")]
    level = head.lower()
    if level not in ("h3", "h2", "h1", "grpc-web"):
        return None
    ttl: float | None = None
    for param in params:
        name, _, raw = param.partition("=")
        if name.strip().lower() == "ma" and raw.strip().isdigit():
            ttl = float(raw.strip())
    return level, ttl


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(task: asyncio.Future[Any]) -> None:
        tasks.discard(task)  # type: ignore[arg-type]
        if not task.cancelled():
            task.exception()  # retrieved: a lost race is not an unhandled error

    return done


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _describe(task: asyncio.Future[Any]) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return f"{type(exc).__name__}: {exc}" if exc else "ok"


def _h2_error_code(exc: BaseException) -> int | None:
    """The HTTP/2 error code inside an httpx/httpcore protocol error (RST_STREAM or GOAWAY)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for arg in current.args:
            code = getattr(arg, "error_code", None)
            if code is not None:
                return int(code)
        current = current.__cause__ or current.__context__
    return None


# --- sync wrapper -------------------------------------------------------------------------------


class SyncChatStream:
    """A ``ChatStream`` driven from synchronous code: ``for token in stream``."""

    def __init__(self, owner: SyncSluicegateClient, stream: ChatStream) -> None:
        self._owner = owner
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return self._owner._call(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Stop reading and cancel an unfinished response."""
        self._owner._call(self._stream.aclose())

    def __enter__(self) -> SyncChatStream:
        self._owner._call(self._stream.start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)  # transport, text, negotiation, usage, ...


class SyncSluicegateClient:
    """The async client on a private event loop in a daemon thread.

    One loop for the client's life keeps connections (QUIC, HTTP/2) and the negotiation memory
    across calls, which ``asyncio.run`` per call would throw away. Use ``close()`` or ``with``.
    """

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sluicegate-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> SluicegateClient:
            return SluicegateClient(base_url, **kwargs)

        self.client = self._call(make())

    def _call(self, coro: Awaitable[T]) -> T:
        if self._closed:
            raise RuntimeError("client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def stream_chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> SyncChatStream:
        """A streamed chat completion: ``for token in client.stream_chat(...)``."""
        return SyncChatStream(self, self.client.stream_chat(model, messages, **params))

    def complete_chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> ChatResult:
        """A whole chat completion."""
        return self._call(self.client.complete_chat(model, messages, **params))

    def close(self) -> None:
        """Close connections and stop the loop thread."""
        if self._closed:
            return
        self._call(self.client.aclose())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncSluicegateClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
