"""HTTP/2 and HTTP/1.1 over TCP, on httpx, with connections that can be opened before the request.

The race against QUIC needs a TCP (and TLS) handshake that finishes before any request is sent, so
that only connections race and a chat request is sent once; httpx cannot do that, so its pool is
given a network backend that hands over a connection won in a race (``_ParkingBackend``).
"""

from __future__ import annotations

import contextlib
import os
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import httpx

from transports.client.exchange import ChatExchange, ChatRequest, ChatTransport
from transports.h3_client import Verify


class HttpxExchange(ChatExchange):
    """An httpx response; its transport is the HTTP version ALPN (or h2c) chose."""

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

    async def ensure_connection(self, scheme: str, host: str, port: int) -> None:
        """Have a connection ready for the origin: reuse one, or do the TCP (and TLS) handshake now."""
        if self.has_connection(scheme, host, port):
            return
        stream = await self.backend.inner.connect_tcp(host, port, timeout=self.connect_timeout)
        if scheme == "https":
            try:
                stream = await stream.start_tls(self.ssl, server_hostname=host, timeout=self.connect_timeout)
            except BaseException:
                await stream.aclose()
                raise
        await self.backend.park(host, port, stream)

    async def open(self, request: ChatRequest) -> ChatExchange:
        req = self.client.build_request("POST", request.url, content=request.body, headers=request.headers)
        response = await self.client.send(req, stream=True)
        return HttpxExchange(response)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.backend.aclose()
