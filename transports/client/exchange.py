"""The seam between the negotiation and the transports: a ``ChatRequest`` in, a ``ChatExchange`` out.

Every transport's response is a ``ChatExchange`` that yields SSE events whatever the wire, so the
stream and the error handling are the same for all; a ``ChatTransport`` (httpx, gRPC-Web, or the
caller's own as ``grpc_web=``) opens one from a request.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from transports.client.events import SSEDecoder, SSEvent


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
