"""Where the relay's splice writes: the client's side of a response, reachable from its ASGI ``send``.

After the first token, the relay hands each pod body chunk from the pod connection's parser callback
straight to the client's connection instead of awaiting one ASGI ``send`` per pod read (see
docs/architecture.md, "Why the hot path looks the way it does"). The response still ends with an
ASGI message, so the server's own bookkeeping (keep-alive, END_STREAM, trailers) stays right; it
starts with one too, except a streamed answer's head under uvicorn's HTTP/1.1, which
``start_response`` writes itself and records in uvicorn's request cycle as uvicorn would.
``client_socket(send)`` finds the target behind ``send``:

- uvicorn's HTTP/1.1: its request cycle holds the client's transport and flow control; once the
  status line is out (chunked), body chunks are written to the transport in chunked framing.
- the gateway's own HTTP/2 and HTTP/3 streams (``transports.asgi_stream.AsgiStream`` on ``h2_server``
  and ``h3_server``): the stream itself; each chunk becomes DATA within the flow-control windows.
- a gRPC-Web call (``gateway.grpc_web_call.Call``): its client's own target, behind a sink that
  translates SSE to frames.

Anything else (another server, a wrapped ``send``) gets None, and the relay uses ASGI sends.
Every target pauses reading from the pod while the client cannot take more, and stops it as soon as
it sees the client gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

Sink = Callable[[bytes], None]


class Upstream(Protocol):
    """The pod answer a splice reads from (``transports.pod_client.PodResponse``)."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...


class SpliceTarget(Protocol):
    """A response's client side that takes body chunks from a callback, not a coroutine."""

    def writer(self, upstream: Upstream) -> Sink:
        """A sink for body chunks; it pauses ``upstream`` while the client is slow, closes it when gone."""
        ...


STREAM_END = b"data: [DONE]\n\n"  # an OpenAI stream's last event
_DONE_END = STREAM_END[-3:]


class ClientSocket:
    """The client's transport and uvicorn's flow control for one HTTP/1.1 response.

    A read that ends the stream (with ``data: [DONE]``) is held back for the response's final
    message (``take_tail``), so that it and the terminating chunk go out in one write, as nginx
    sends them: one system call and one wake-up of the client fewer a request."""

    __slots__ = ("flow", "tail", "transport")

    def __init__(self, transport: asyncio.Transport, flow: Any) -> None:
        self.transport = transport
        self.flow = flow
        self.tail = b""

    def take_tail(self) -> bytes:
        """The held last read (b"" if none), for the body of the response's final message."""
        tail, self.tail = self.tail, b""
        return tail

    def writer(self, upstream: Upstream) -> Sink:
        """A sink for body chunks: frame, write, and pause ``upstream`` while the client is slow."""
        return _ChunkSink(self, upstream)


class _ChunkSink:
    """``ClientSocket.writer``'s sink: one call a pod read, so its reads are bound once, here.

    A class, not a closure: compiled, a closure's variables live in an object that holds the
    closure itself, a cycle only the garbage collector frees, and with it the whole request."""

    __slots__ = ("drain", "flow", "is_closing", "socket", "upstream", "write")

    def __init__(self, socket: ClientSocket, upstream: Upstream) -> None:
        self.socket = socket
        self.upstream = upstream
        self.write = socket.transport.write
        self.is_closing = socket.transport.is_closing
        self.flow = socket.flow
        self.drain: asyncio.Future[None] | None = None

    def __call__(self, body: bytes) -> None:
        if self.is_closing():
            # The client left; the disconnect watch ends the request. Stop reading the pod now.
            self.upstream.close()
            return
        socket = self.socket
        if socket.tail:  # a pod that went on after its last event: what was held goes first
            held = socket.take_tail()
            self.write(b"%x\r\n%b\r\n" % (len(held), held))
        # its last three bytes first: a slice's compare is cheaper than ``endswith``, and a
        # token's read ends with "}\n\n"
        if body[-3:] == _DONE_END and body.endswith(STREAM_END):
            socket.tail = body
            return
        self.write(b"%x\r\n%b\r\n" % (len(body), body))
        if self.flow.write_paused and self.drain is None:
            self.upstream.pause_reading()
            self.drain = asyncio.ensure_future(self._resume_when_drained())

    async def _resume_when_drained(self) -> None:
        await self.flow.drain()  # uvicorn also releases this when the client disconnects
        self.drain = None
        self.upstream.resume_reading()


def _uvicorn_cycle(send: Callable[[dict[str, Any]], Awaitable[None]]) -> tuple[Any, Any, Any]:
    """The object behind ``send`` and, when it is uvicorn's HTTP/1.1 request cycle, its client's
    transport and flow control (None each otherwise)."""
    owner = getattr(send, "__self__", None)
    return owner, getattr(owner, "transport", None), getattr(owner, "flow", None)


class _Gathered:
    """Stands in for uvicorn's transport while a response's head and first chunk are framed."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)


async def start_response(
    send: Callable[[dict[str, Any]], Awaitable[None]], start: dict[str, Any], first: dict[str, Any]
) -> None:
    """Send a response's ``start`` and ``first`` body messages; under uvicorn's HTTP/1.1, as one write.

    uvicorn writes the status line and headers on ``http.response.start`` and each body on its own:
    two system calls, and two wake-ups of the client, before it sees the first token. A streamed
    answer's head (chunked, no length) is written here in uvicorn's stead (``_chunked_head``); any
    other start is framed by uvicorn itself (its keep-alive and chunked state stay its own) into a
    stand-in for its transport, and the bytes go out together. Neither message can wait for the
    client (its write buffer is not full: checked first), so nothing else runs meanwhile. Any other
    server, or a full buffer, gets the two messages as they are."""
    owner, transport, flow = _uvicorn_cycle(send)
    if transport is None or flow is None or flow.write_paused or getattr(owner, "response_started", True):
        await send(start)
        await send(first)
        return
    head = _chunked_head(owner, start) if first.get("more_body") else None
    if head is not None:
        body = first.get("body", b"")
        if not transport.is_closing():
            transport.write(head + b"%x\r\n%b\r\n" % (len(body), body) if body else head)
        return
    gathered = _Gathered()
    owner.transport = gathered  # type: ignore[union-attr]
    try:
        await send(start)
        await send(first)
    finally:
        owner.transport = transport  # type: ignore[union-attr]
    if gathered.parts and not transport.is_closing():
        transport.write(b"".join(gathered.parts))


# Headers whose presence changes how uvicorn frames the body: a start carrying one is left to uvicorn.
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))
# What uvicorn lets through in a header value (all but its HEADER_VALUE_RE): tab, visible bytes, space,
# obs-text. Deleting them from a head must leave exactly one CR LF for each line written.
_FIELD_BYTES = bytes(b for b in range(256) if b == 9 or 32 <= b != 127)


def _chunked_head(cycle: Any, start: dict[str, Any]) -> bytes | None:
    """The status line and headers uvicorn's ``send`` would write for a streamed (chunked) answer,
    with its request cycle moved on as that ``send`` moves it; None where uvicorn must decide.

    uvicorn checks each header with two regular expressions, ~5 % of a request's instructions for
    the dozen headers of a stream's start (``docs/benchmarks.md``). Here the names are the gateway's
    own constants, and the values (a request id, a pod name, counters, an echoed origin) are checked
    in one pass over the whole head (``bytes.translate``; one regular expression over it cost as much
    as uvicorn's): nothing uvicorn refuses, and nothing between the lines but one CR LF each. A head
    that fails goes to uvicorn, which refuses it as before."""
    if cycle.disconnected or cycle.access_log or cycle.chunked_encoding is not None:
        return None
    status_line = STATUS_LINE.get(start["status"])
    if status_line is None or start["status"] in (204, 304) or cycle.scope["method"] == "HEAD":
        return None
    parts = [status_line]
    for name, value in (*cycle.default_headers, *start.get("headers", ())):
        if name in _FRAMING:
            return None
        parts += (name, b": ", value, b"\r\n")
    lines = len(parts) // 4 + 3  # the status line, the headers, transfer-encoding, the blank line
    if not cycle.keep_alive:
        parts.append(b"connection: close\r\n")
        lines += 1
    parts.append(b"transfer-encoding: chunked\r\n\r\n")
    head = b"".join(parts)
    if head.translate(None, _FIELD_BYTES) != b"\r\n" * lines:
        return None
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = True
    return head


def client_socket(send: Callable[[dict[str, Any]], Awaitable[None]]) -> SpliceTarget | None:
    """The splice target behind ``send`` once its response has started, else None (see module doc)."""
    owner, transport, flow = _uvicorn_cycle(send)
    target = getattr(owner, "splice_target", None)
    if target is not None:  # the gateway's HTTP/2 and HTTP/3 streams, a gRPC-Web call: the owner says
        return target()  # type: ignore[no-any-return]
    if transport is None or flow is None or getattr(owner, "chunked_encoding", None) is not True:
        return None
    return ClientSocket(transport, flow)
