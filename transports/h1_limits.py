"""Bounds on what one HTTP/1.1 client can make the gateway wait for or hold, under uvicorn.

uvicorn's httptools protocol has a keep-alive timer between requests and nothing else: a client
may take forever to send a request's head or body, and llhttp buffers a header line of any length.
Thousands of such connections cost memory and file descriptors while doing nothing (slowloris, slow
POST). ``GuardedH1Protocol`` adds, with timers and counters that cost nothing per byte:

- **head**: the request line and headers must arrive within ``head_timeout_s`` of the first byte
  (of the connection, for its first request) → 408 and close;
- **body**: once the head is in, the body may idle at most ``body_idle_timeout_s`` between reads
  and must be complete ``body_timeout_s`` after the head → 408 and close, and the app sees the
  client as gone (the relay never reaches a pod, or drops the pod request);
- **size**: a request line over ``max_request_line_bytes`` → 414; more than ``max_headers``
  headers, or more than ``max_header_bytes`` of names and values → 431; a head that keeps coming
  without ending is cut off at the sum of those bounds (llhttp would buffer it whole).

Malformed framing (Content-Length with Transfer-Encoding, two Content-Lengths, a bad chunk size, an
unknown transfer coding) is refused by llhttp in its strict mode, which uvicorn keeps: 400 and
close, so a request cannot be smuggled past the gateway. Every refusal here is an OpenAI error
body with ``Connection: close``, unless the app has already begun its answer (then the connection
simply closes).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from transports.h1_disconnect import PromptH1Protocol

logger = logging.getLogger("sluicegate.transports")


@dataclass(frozen=True, slots=True)
class H1Limits:
    """What one HTTP/1.1 request may take (time) and carry (head size)."""

    head_timeout_s: float = 10.0
    body_idle_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_request_line_bytes: int = 8 * 1024
    max_headers: int = 100
    max_header_bytes: int = 64 * 1024


def error_json(message: str, code: str) -> bytes:
    """An OpenAI error object (transports do not import the gateway's own ``errors``)."""
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
        separators=(",", ":"),
    ).encode()


def error_response(status: int, message: str, code: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 answer carrying an OpenAI error object, closing the connection."""
    body = error_json(message, code)
    head = [STATUS_LINE[status]]
    for name, value in default_headers:
        head += [name, b": ", value, b"\r\n"]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % len(body))
    return b"".join(head) + body


class _Refused(Exception):
    """Raised from a parser callback; llhttp turns it into a parse error, so uvicorn stops parsing and
    calls ``send_400_response``, which answers with the refusal recorded beside it."""


class GuardedH1Protocol(PromptH1Protocol):
    """uvicorn's httptools protocol with head and body deadlines and head size limits (see module doc)."""

    # In slots, not the instance dict: uvicorn's own ~28 attributes and these 12 made a dict past
    # CPython's 30 shared keys, a 1.6 KB table a connection instead of a ~0.4 KB split one.
    __slots__ = (
        "_body_deadline", "_body_timer", "_head_budget", "_head_bytes", "_head_timer", "_header_bytes",
        "_in_body", "_in_head", "_last_rx", "_refusal", "head_started", "limits",
    )

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        limits: H1Limits | None = None,
    ) -> None:
        super().__init__(config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        self.limits = lim = limits or H1Limits()
        # a head still coming past this many bytes cannot fit the limits (": " and CRLF per header)
        self._head_budget = lim.max_request_line_bytes + lim.max_header_bytes + 4 * lim.max_headers + 16
        self.head_started: float | None = None  # set by a dispatcher that read the first bytes itself
        self._in_head = True  # awaiting (the rest of) a request head
        self._head_bytes = 0
        self._header_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_body = False  # head in, body still coming
        self._body_deadline = 0.0
        self._last_rx = 0.0
        self._body_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.head_started is None:  # nothing read yet: the first head's clock starts now
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
        # else a dispatcher read the first bytes and hands them over next (``data_received``)

    def data_received(self, data: bytes) -> None:
        # A head's clock starts at its first byte, but its timer is armed only if the head is still
        # incomplete once this read is parsed: a head that arrives in one read (almost every one)
        # never makes and cancels a timer.
        head_from = 0.0
        if self._in_head:
            if self._head_timer is None:
                head_from = self.head_started or self.loop.time()
                self.head_started = None
            self._head_bytes += len(data)
        elif self._in_body:
            self._last_rx = self.loop.time()
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes:  # a head begun and not complete
            if self._head_bytes > self._head_budget:
                self._refuse(431, "request head too large", "request_header_fields_too_large")
            elif head_from:  # its timer was not armed before this read (and parsing arms none)
                self._head_timer = self.loop.call_at(
                    head_from + self.limits.head_timeout_s, self._head_timed_out
                )
        elif self._in_body and self._body_timer is None:
            self._arm_body_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    # -- parser callbacks ------------------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line_bytes:
            self._refusal = (414, "request line too long", "uri_too_long")
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if len(self.headers) >= self.limits.max_headers:
            self._refusal = (431, f"more than {self.limits.max_headers} headers",
                             "request_header_fields_too_large")
            raise _Refused
        if self._header_bytes > self.limits.max_header_bytes:
            self._refusal = (431, "request headers too large", "request_header_fields_too_large")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._in_head = False
        self._head_bytes = self._header_bytes = 0
        self._in_body = True
        now = self._last_rx = self.loop.time()
        self._body_deadline = now + self.limits.body_timeout_s
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._in_head = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        status, message, code = self._refusal or (400, "malformed HTTP/1.1 request", "invalid_request")
        self._refusal = None
        self._refuse(status, message, code)

    # -- deadlines -------------------------------------------------------------------------------

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # the next request's head is early (pipelined) while an answer streams: end after it
            cycle.keep_alive = False
            return
        if self._head_bytes == 0:
            self.transport.close()  # nothing asked: nothing to answer
            return
        self._refuse(408, "request head not received in time", "request_timeout")

    def _arm_body_timer(self) -> None:
        when = min(self._last_rx + self.limits.body_idle_timeout_s, self._body_deadline)
        self._body_timer = self.loop.call_at(when, self._body_check)

    def _body_check(self) -> None:
        self._body_timer = None
        if not self._in_body or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            self._last_rx = now  # the app is not reading: the client is not the one idling
        if now >= self._body_deadline:
            self._refuse(408, "request body not received in time", "request_timeout")
        elif now - self._last_rx >= self.limits.body_idle_timeout_s:
            self._refuse(408, "request body stalled", "request_timeout")
        else:
            self._arm_body_timer()

    # -- refusing --------------------------------------------------------------------------------

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` (unless an answer has begun), close, and tell the app the client left."""
        transport = self.transport
        self._cancel_timers()
        in_body, self._in_head, self._in_body = self._in_body, False, False
        cycle = self.cycle  # this request's in its body, the one before while awaiting a head
        answering = cycle is not None and cycle.response_started and (in_body or not cycle.response_complete)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if not answering and not transport.is_closing():
            logger.info("HTTP/1.1 client %s refused: %d %s", self.client, status, message)
            transport.write(error_response(status, message, code, self.server_state.default_headers))
        transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
