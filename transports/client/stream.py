"""A streamed chat completion as the caller iterates it: tokens out, everything else handled.

The stream turns each event into a token, an end or an error, and is where "retry only while
nothing has reached the caller" is enforced: a failure before the first token goes back to the
client's negotiation, one after it ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from transports.client.errors import SluicegateError, error_from_body, error_from_payload, parse_retry_after
from transports.client.events import SSEvent
from transports.client.exchange import ChatExchange, ChatRequest
from transports.client.results import Negotiation

if TYPE_CHECKING:
    from transports.client.negotiating import SluicegateClient


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
            exchange = await self._client._open(self._request, self.negotiation)
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
