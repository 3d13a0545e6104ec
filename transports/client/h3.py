"""HTTP/3 responses as ``ChatExchange``s; the connections themselves are transports/h3_client.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator

from transports.client.exchange import ChatExchange
from transports.h3_client import H3Response


class H3Exchange(ChatExchange):
    """A response on a QUIC connection, read with the client's read timeout."""

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
