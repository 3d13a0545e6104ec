"""The client's gRPC-Web transport: ``sluicegate.v1.Inference`` calls that read like SSE answers.

For a gateway that directs gRPC-Web (or a caller who asks for it), each call's messages come back
as the OpenAI chunk JSON they stand for, so the stream and error handling are the same as for every
other transport. The wire format is transports/grpc_web.py's (the gateway's own codec).

This module loads protobuf and the generated messages; the client imports it only once a request
goes over gRPC-Web.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from google.protobuf import json_format

from transports import grpc_web as codec
from transports.client.errors import SluicegateError, parse_retry_after
from transports.client.events import SSEvent
from transports.client.exchange import ChatExchange, ChatRequest, ChatTransport
from transports.client.tcp import HttpxExchange, HttpxTransport
from transports.h3_client import Verify
from transports.proto.sluicegate.v1 import inference_pb2 as pb

GRPC_SERVICE = "sluicegate.v1.Inference"
# gRPC status -> the HTTP status the gateway chose it for (transports/grpc_web.HTTP_TO_GRPC, inverted)
_GRPC_TO_HTTP = {1: 499, 3: 400, 4: 504, 5: 404, 7: 403, 8: 429, 9: 412, 10: 409, 12: 501, 13: 500,
                 14: 503, 16: 401}  # fmt: skip


def _grpc_status(fields: dict[str, str]) -> tuple[int, str] | None:
    """``grpc-status`` and the decoded ``grpc-message`` from headers or trailers, if there."""
    if "grpc-status" not in fields:
        return None
    raw = fields.get("grpc-message", "")
    return int(fields["grpc-status"]), codec.percent_decode(raw.encode("latin-1"))


def _status_name(status: int) -> str:
    try:
        return codec.Status(status).name
    except ValueError:
        return str(status)


def _as_json(message: Any) -> str:
    """A protobuf message as the OpenAI JSON it mirrors (the proto keeps OpenAI's field names)."""
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True))


class GrpcWebExchange(HttpxExchange):
    """A gRPC-Web call's response, read as the OpenAI chunks (or completion) it carries.

    A Trailers-Only answer (the status in the headers) looks like the HTTP error it stands for,
    so the client's error handling is the same as for SSE; a failing status in the trailers after
    messages raises ``SluicegateError`` (in stream).
    """

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response)
        self.transport = "grpc-web"
        self._early = _grpc_status(dict(self.headers)) if response.status_code == 200 else None
        if self._early is not None and self._early[0] != 0:
            self.status = _GRPC_TO_HTTP.get(self._early[0], 500)

    async def _messages(self) -> AsyncIterator[bytes]:
        """Message payloads; raises on a failing trailers status or a truncated body."""
        deframer = codec.Deframer()
        trailers: dict[str, str] | None = None
        async for chunk in self.aiter_bytes():
            for frame in deframer.feed(chunk):
                if frame.is_trailers:
                    trailers = codec.parse_trailers(frame.payload)
                elif frame.is_compressed:
                    raise SluicegateError(
                        "compressed gRPC-Web message (not negotiated)", transport="grpc-web"
                    )
                else:
                    yield frame.payload
        status = _grpc_status(trailers or {}) if trailers is not None else self._early
        if status is None:
            raise SluicegateError(
                "gRPC-Web answer ended without trailers", transport="grpc-web", in_stream=True
            )
        if status[0] != 0:
            name = _status_name(status[0])
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
        async for payload in self._messages():
            yield SSEvent("message", _as_json(pb.ChatCompletionChunk.FromString(payload)))
        yield SSEvent("message", "[DONE]")

    async def read(self) -> bytes:
        if self._early is not None and self._early[0] != 0:
            status, message = self._early
            error = {"message": message, "type": "grpc_error", "code": _status_name(status)}
            return json.dumps({"error": error}).encode()
        if self.status >= 300:
            return await self._response.aread()
        payloads = [payload async for payload in self._messages()]
        if not payloads:
            raise SluicegateError("gRPC-Web answer without a message", transport="grpc-web")
        return _as_json(pb.ChatCompletion.FromString(payloads[-1])).encode()


class GrpcWebTransport(ChatTransport):
    """Chat over gRPC-Web (``sluicegate.v1.Inference``, binary protobuf) on httpx: h2 where ALPN
    offers it, else HTTP/1.1. The request's OpenAI parameters that the proto has no field for are
    left out (see proto/sluicegate/v1/inference.proto)."""

    name = "grpc-web"

    def __init__(self, verify: Verify, connect_timeout: float, read_timeout: float | None) -> None:
        self._http = HttpxTransport("auto", verify, connect_timeout, read_timeout)

    async def open(self, request: ChatRequest) -> ChatExchange:
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
        return GrpcWebExchange(response)

    async def aclose(self) -> None:
        await self._http.aclose()
