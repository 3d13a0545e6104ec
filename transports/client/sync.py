"""The client for synchronous code, keeping what the async client learns and holds between calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from transports.client.negotiating import SluicegateClient
from transports.client.results import ChatResult
from transports.client.stream import ChatStream

T = TypeVar("T")


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
