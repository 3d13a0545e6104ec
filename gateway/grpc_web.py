"""gRPC-Web in front of the relay: ``sluicegate.v1.Inference`` (see proto/ and docs/grpc-web.md).

A transport adapter, not a second request path. Each call becomes the OpenAI JSON body an HTTP
client would have sent to ``/v1/chat/completions``, and runs through the same ``Relay.__call__``
(admission, limits, tiers, timeouts, routing, retries, resume, shedding, metrics, access log).
The per-call adapter is ``gateway/grpc_web_call.py``; the translation between protobuf and OpenAI
JSON is ``gateway/grpc_web_messages.py`` (the generated code) and ``gateway/grpc_web_chunks.py``
(the hand-written serialization of a token chunk, on the hot path). What differs on the wire:

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

The relay's splice (pod bytes written to the client from the pod connection's callback) finds its
target through ``send.__self__``; the wrapper's ``send`` is a method of the per-call adapter, whose
``splice_target`` is the client connection's own target behind a sink that translates SSE to
frames (``grpc_web_call.Splice``). So a gRPC-Web stream splices wherever an HTTP one does, with
no ASGI send per pod read. The synthetic ``receive`` is instead bound to the server's request
cycle (``receive.__self__``) when there is one, so the relay's tripwire and hang-up watcher
install on the real connection exactly as for an HTTP client.

Per event: a pod read that is one vLLM token event differing from the stream's previous one only
in its content becomes its message frame from its bytes alone (``ChunkEncoder.token_frame``: no
JSON parse, the frame's head cached by content length); a token event in any other read is
serialized from its bytes too (``ChunkEncoder.token``); any other event costs one ``json.loads``
and a hand-written serialization that the tests hold to the generated code's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from gateway.admit import GRPC_WEB_PREFIX as PREFIX
from gateway.deadlines import CLIENT_TIMEOUT_HEADER
from gateway.grpc_web_call import Call, header, trailers_only
from gateway.grpc_web_chunks import ChunkEncoder, parse_json
from gateway.grpc_web_messages import chunk_message, openai_body
from gateway.relay import Receive, Relay, Scope, Send
from transports import grpc_web as codec
from transports.grpc_web import Status

# Re-exported: the translation's tests import these from here.
__all__ = ["ChunkEncoder", "GrpcWebEndpoint", "chunk_message", "openai_body", "parse_json"]


METHODS = {"StreamChatCompletion": True, "ChatCompletion": False}  # method → server streaming?

ALLOW_HEADERS = ("content-type", "x-grpc-web", "x-user-agent", "grpc-timeout", "authorization",
                 "x-api-key", "x-request-id", "x-request-timeout-ms")  # fmt: skip
EXPOSE_HEADERS = (
    b"grpc-status,grpc-message,grpc-status-details-bin,x-request-id,x-sluicegate-pod,x-sluicegate-variant,"
    b"retry-after,x-sluicegate-degraded,x-ratelimit-limit-requests,x-ratelimit-remaining-requests,"
    b"x-ratelimit-reset-requests,x-ratelimit-limit-tokens,x-ratelimit-remaining-tokens,x-ratelimit-reset-tokens"
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
        origin = header(headers, b"origin")
        cors = self._cors(origin)
        if scope["method"] == "OPTIONS":
            await self._preflight(headers, origin, cors, send)
            return
        stream = METHODS.get(scope["path"][len(PREFIX) :])
        if stream is None:
            message = f"Method {scope['path']} is not implemented here."
            await trailers_only(send, 200, Status.UNIMPLEMENTED, message, cors)
            return
        if scope["method"] != "POST":
            message = f"HTTP method {scope['method']} is not allowed; gRPC-Web calls are POSTs."
            await trailers_only(
                send, 405, Status.UNIMPLEMENTED, message, cors, ((b"allow", b"POST, OPTIONS"),)
            )
            return
        text = codec.text_mode(header(headers, b"content-type") or b"")
        if text is None:
            message = (
                "Unsupported content type; use application/grpc-web[+proto] or application/grpc-web-text."
            )
            await trailers_only(send, 415, Status.INVALID_ARGUMENT, message, cors)
            return
        try:
            relay_headers = _relay_headers(headers)
        except codec.ProtocolError as exc:
            await trailers_only(send, 200, Status.INVALID_ARGUMENT, str(exc), cors)
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
            asked = header(headers, b"access-control-request-headers")
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


def _relay_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers as the relay should see them: the envelope's left out, the body labelled
    JSON, and ``grpc-timeout`` as the relay's ``X-Request-Timeout-Ms`` (the shorter, with the
    client's own)."""
    out = [(n, v) for n, v in headers if n not in _ENVELOPE]
    out.append((b"content-type", b"application/json"))
    deadline_ms: int | None = None
    grpc_timeout = header(headers, b"grpc-timeout")
    if grpc_timeout is not None:
        deadline_ms = max(1, math.ceil(codec.parse_timeout(grpc_timeout) * 1000))
    asked = header(headers, CLIENT_TIMEOUT_HEADER)
    if asked is not None:
        if not asked.strip().isdigit() or deadline_ms is None:
            out.append((CLIENT_TIMEOUT_HEADER, asked))  # the relay judges it (a 400 when it is not a number)
            return out
        deadline_ms = min(deadline_ms, int(asked))
    if deadline_ms is not None:
        out.append((CLIENT_TIMEOUT_HEADER, b"%d" % deadline_ms))
    return out
