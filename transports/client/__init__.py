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
The package keeps one concept per module (the transport seam, each transport, the race, the
stream, the negotiation); this file is the public API. See docs/client.md.
"""

from __future__ import annotations

from typing import Any

from transports.client.downgrade import DOWNGRADE_HEADER, parse_downgrade
from transports.client.errors import (
    SluicegateError,
    SluicegateTransportError,
    error_from_body,
    error_from_payload,
    parse_retry_after,
)
from transports.client.events import SSEDecoder, SSEvent
from transports.client.exchange import ChatExchange, ChatRequest, ChatTransport
from transports.client.negotiating import TRANSPORTS, SluicegateClient
from transports.client.race import DEFAULT_RACE_DELAY, MAX_RACE_DELAY
from transports.client.results import ChatResult, Negotiation
from transports.client.stream import ChatStream
from transports.client.sync import SyncChatStream, SyncSluicegateClient
from transports.client.tcp import HttpxTransport, ssl_context
from transports.h3_client import Verify

__all__ = [
    "DEFAULT_RACE_DELAY",
    "DOWNGRADE_HEADER",
    "MAX_RACE_DELAY",
    "TRANSPORTS",
    "ChatExchange",
    "ChatRequest",
    "ChatResult",
    "ChatStream",
    "ChatTransport",
    "GrpcWebTransport",
    "HttpxTransport",
    "Negotiation",
    "SSEDecoder",
    "SSEvent",
    "SluicegateClient",
    "SluicegateError",
    "SluicegateTransportError",
    "SyncChatStream",
    "SyncSluicegateClient",
    "Verify",
    "error_from_body",
    "error_from_payload",
    "parse_downgrade",
    "parse_retry_after",
    "ssl_context",
]


def __getattr__(name: str) -> Any:
    """``GrpcWebTransport`` on first use: its module loads protobuf, which a client may never need."""
    if name == "GrpcWebTransport":
        from transports.client.grpc_web import GrpcWebTransport

        return GrpcWebTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
